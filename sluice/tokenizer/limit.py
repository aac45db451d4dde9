"""Refusing a prompt longer than the context at a cost bounded by the context, not by the prompt.

Tokenizing a whole text costs time and memory in proportion to it: 1M characters of one CJK letter took 9.7 s and
720 MiB (3M tokens) here, so a 10 MB request body could take a server down before any length check ran.
`tokens_at_least(tokenizer, text, cap)` looks at the text piece by piece and stops as soon as it has proved that
the text is more than `cap` tokens; its cost is O(cap) tokens of work, whatever the length of the text.

How a piece is counted. Tokenizer pipelines (added tokens, normalizer, pre-tokenizer, model) are local: the text is
cut into words, and each word is tokenized alone. So in `encode(text[pos:pos + PIECE])` the tokens of every word
that ends well before the end of the piece (MARGIN characters: room for a special token, a normalizer's pattern or
the pre-tokenizer's look-ahead cut by the piece's end) are the tokens the whole text has there. Those are counted
and the next piece starts at the next word. The first word of a piece can differ from the whole text's (a
normalizer's prepended "▁", a stripped space), so each piece counts SLACK tokens fewer: the count stays a lower
bound.

A word longer than a piece (the CJK run above; byte-level BPE keeps a run of letters in one word) stops that walk.
For the rest of the text, the bound is then its normalized UTF-8 bytes divided by the most bytes one token covers
(the longest token in the vocabulary, added tokens included): every byte of the normalized text lies in some token
when the model cannot drop or fuse unknown characters (BPE with byte fallback, a byte-level alphabet, or an
unfused unk token). For other tokenizers there is no such bound and the text is tokenized whole (the server's body
limit then bounds the cost).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import check_text

if TYPE_CHECKING:
    from . import Tokenizer

# Characters tokenized per piece: ~4K tokens of English, ~1 MiB of transient tokenizer memory; prompts up to this
# long are tokenized whole (the walk would cost as much).
PIECE = 16384
# Tokens of words ending in the last MARGIN characters of a piece are not counted: longer than any special token
# of the supported models' vocabularies (<|im_start|> is 12) and any normalizer pattern or regex look-ahead.
MARGIN = 256
# Tokens a piece's first word may differ by from the whole text's (see the module docstring).
SLACK = 2
# Bytes the normalizer may see differently at a cut between two pieces (a composed character or a pattern spanning
# the cut).
BYTE_SLACK = 16

_PER_TOKEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> _bytes_per_token(its backend)


@dataclass
class Floor:
    """`tokens`: a lower bound on the token count of the text, proved from its first `chars` characters."""

    tokens: int
    chars: int


def tokens_at_least(tokenizer: Tokenizer, text: str, cap: int) -> Floor:
    """A lower bound on `len(tokenizer.encode(text, add_special_tokens=False))`, exact for texts up to PIECE
    characters; stops reading as soon as the bound exceeds `cap`, so the cost is O(cap) tokens."""
    check_text(text)
    backend = tokenizer.backend
    count, pos = 0, 0
    while pos < len(text) and count <= cap:
        end = pos + PIECE
        if end >= len(text):  # the rest fits in a piece: count it exactly
            n = len(backend.encode(text[pos:], add_special_tokens=False).ids)
            return Floor(max(0, count + n - (SLACK if pos else 0)), len(text))
        enc = backend.encode(text[pos:end], add_special_tokens=False)
        final = _final_tokens(enc.offsets, enc.word_ids, PIECE - MARGIN)
        step = enc.offsets[final][0] if final else 0
        if step <= 0:  # one word longer than a piece: bound the rest by its bytes
            return Floor(count + _bytes_floor(tokenizer, text, pos, cap - count), len(text))
        count += max(0, final - (SLACK if pos else 0))
        pos += step
    return Floor(count, pos)


def _final_tokens(offsets: list[tuple[int, int]], word_ids: list[int | None], safe: int) -> int:
    """How many leading tokens belong to words that end by character `safe` (whole words only)."""
    if not offsets:
        return 0
    i = next((k for k, (_, stop) in enumerate(offsets) if stop > safe), len(offsets))
    if i == len(offsets):
        i -= 1  # the piece ended inside the margin without a token crossing it: keep the last word out anyway
    while i > 0 and word_ids[i] is not None and word_ids[i - 1] == word_ids[i]:
        i -= 1
    return i


def _bytes_floor(tokenizer: Tokenizer, text: str, pos: int, cap: int) -> int:
    """Normalized UTF-8 bytes of `text[pos:]` / the most bytes a token covers; stops once past `cap`. 0 when the
    tokenizer has no such bound (see the module docstring)."""
    per_token = _PER_TOKEN.get(tokenizer)
    if per_token is None:
        per_token = _PER_TOKEN[tokenizer] = _bytes_per_token(tokenizer.backend)
    if not per_token:
        return 0
    longest, strips = per_token
    normalizer = tokenizer.backend.normalizer
    nbytes, tokens = 0, 0
    for start in range(pos, len(text), PIECE):
        piece = text[start:start + PIECE]
        if normalizer is not None:
            piece = normalizer.normalize_str(piece)
        if strips:  # an added token with lstrip/rstrip swallows whitespace next to it: count none of it
            piece = "".join(piece.split())
        nbytes += max(0, len(piece.encode("utf-8")) - (BYTE_SLACK if start > pos else 0))
        tokens = -(-nbytes // longest)
        if tokens > cap:
            break
    return tokens


def _bytes_per_token(backend) -> tuple[int, bool] | tuple[()]:
    """(most UTF-8 bytes of text one token covers, whether added tokens strip whitespace), or () when a token may
    cover more text than its own string (fused unknowns, truncation) and no byte bound holds."""
    model = backend.model
    if backend.truncation is not None or type(model).__name__ != "BPE":
        return ()  # Unigram fuses unknown characters into one token; WordPiece and WordLevel map words to [UNK]
    if model.unk_token is not None and model.fuse_unk and not model.byte_fallback:
        return ()
    byte_level = backend.pre_tokenizer is not None and b'"ByteLevel"' in backend.pre_tokenizer.__getstate__()
    if model.unk_token is None and not model.byte_fallback and not byte_level:
        return ()  # characters outside the vocabulary are dropped
    # A byte-level token's characters stand for one byte each and "▁" for one space: a token's own UTF-8 length
    # is at least the bytes of text it covers.
    longest = max(len(t.encode("utf-8")) for t in backend.get_vocab(with_added_tokens=True))
    strips = any(t.lstrip or t.rstrip for t in backend.get_added_tokens_decoder().values())
    return max(longest, 1), strips
