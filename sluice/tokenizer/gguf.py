"""The tokenizer a GGUF file describes in its metadata, encoding text to the ids llama.cpp gives.

A GGUF carries no tokenizer.json: `tokenizer.ggml.*` keys hold the vocabulary, the token types, the BPE merges or the
SentencePiece scores, the special ids and flags, and `tokenizer.chat_template` the prompt template. This module turns
them into a sluice `Tokenizer` that follows llama.cpp's `src/llama-vocab.cpp` (read to learn the rules; nothing is
copied):

- Special tokens first: every token typed CONTROL, USER_DEFINED or UNKNOWN is cut out of the text as a whole string,
  longest token first, before the model sees any text (llama.cpp's `tokenizer_st_partition` with parse_special).
  Tokens llama.cpp recognises by their text as end-of-generation or fill-in-middle markers count as CONTROL even
  when the file types them otherwise, and Phi-3's specials (known by `general.name`) eat the whitespace after them.
- `tokenizer.ggml.model == "gpt2"`: byte-level BPE. The text between specials is split by the regexes llama.cpp
  attaches to `tokenizer.ggml.pre` (no Unicode normalization), each piece mapped to the GPT-2 byte alphabet and
  merged by rank. The split and the merges run in the `tokenizers` library (Rust), with llama.cpp's regexes.
- `tokenizer.ggml.model == "llama"`: SentencePiece BPE as llama.cpp computes it: spaces become U+2581, a space is
  prepended to text that starts the prompt or follows a special token (`add_space_prefix`), then adjacent symbols
  merge while their concatenation is a token, highest score first (leftmost on ties); leftovers become byte tokens
  <0xXX>. This loop is Python: no `tokenizers` model merges by score over any split of a token.
- bos / eos are added per `tokenizer.ggml.add_bos_token` / `add_eos_token`, with llama.cpp's defaults per model and
  pre-tokenizer when the file says nothing.

Decoding concatenates llama.cpp's token pieces (byte-level tokens back to bytes, U+2581 back to a space, <0xXX> to
its byte) and, for SentencePiece, drops the prefix space of a first token that is not bos. It does not apply
llama.cpp's `clean_spaces` pass (llama_detokenize only; llama-server's streamed pieces skip it too).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from tokenizers import Regex
from tokenizers import Tokenizer as _Backend
from tokenizers import decoders, models, pre_tokenizers

from sluice.errors import CheckpointError, ConfigError, RequestError
from sluice.tokenizer import Tokenizer, check_text
from sluice.tokenizer.special import EOG_TEXTS as _EOG_TEXTS
from sluice.tokenizer.special import FIM_EOG_TEXTS as _FIM_EOG_TEXTS
from sluice.tokenizer.special import FIM_TEXTS as _FIM_TEXTS

# llama.cpp's token types (llama.h LLAMA_TOKEN_TYPE_*, gguf.TokenType)
UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(7)
_MATCHED_WHOLE = (CONTROL, USER_DEFINED, UNKNOWN)  # cut out of the text before the model runs
_SKIPPED = (CONTROL, UNKNOWN)  # rendered as "" by decode(skip_special_tokens=True)

# ---- pre-tokenizers: llama.cpp's regexes per `tokenizer.ggml.pre` (llm_tokenizer_bpe) -----------------------------
# llama.cpp spells (?i:'s|...) as [sS] alternatives because std::regex has no inline flags; onig accepts both, and
# the spelled-out form cannot case-fold beyond ASCII ("'ſ"), as llama.cpp cannot.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|"
           r"\s+(?!\S)|\s+")  # Qwen3.5: letter runs take combining marks along


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text for one `tokenizer.ggml.pre` value, and the flags that name sets."""

    regexes: tuple[str, ...]  # applied in turn, each splitting the pieces of the one before (matches and gaps kept)
    ignore_merges: bool = False  # a piece that is itself a token is taken whole
    add_bos: bool = False  # default when the file has no tokenizer.ggml.add_bos_token


_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_GPT2_PRE = PreTokenizer((_GPT2,))
_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = PreTokenizer((_QWEN2,))
_STARCODER_PRE = PreTokenizer((r"\p{N}", _GPT2))

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "gigachat", "exaone4"), _GPT2_PRE),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
                    _LLAMA3_PRE),
    "dbrx": PreTokenizer((_LLAMA3,)),
    "smaug-bpe": PreTokenizer((_LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), _QWEN2_PRE),
    "qwen35": PreTokenizer((_QWEN35,)),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
                    _STARCODER_PRE),
}
MODELS = ("gpt2", "llama")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable Latin-1 bytes stand for themselves, the rest map to U+0100 and up."""
    out = {b: chr(b) for b in (*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100))}
    rest = [b for b in range(256) if b not in out]
    return {**out, **{b: chr(256 + k) for k, b in enumerate(rest)}}


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}  # GPT-2's byte alphabet, character -> byte


# ---- reading the metadata ------------------------------------------------------------------------------------------
@dataclass
class GGUFVocab:
    """The tokenizer metadata of one GGUF, checked, with llama.cpp's defaults applied."""

    model: str  # "gpt2" | "llama"
    pre: str | None  # tokenizer.ggml.pre (gpt2 only)
    tokens: list[str]
    types: list[int]  # after llama.cpp's by-text CONTROL promotion
    scores: list[float]  # float32 values (llama only; 0.0 when absent)
    merges: list[tuple[str, str]]  # first occurrence of each pair, in rank order (gpt2 only)
    ids: dict[str, int] = field(repr=False)  # token text -> id
    special: dict[str, int | None] = field(default_factory=dict)  # bos, eos, unk, pad, sep, mask, eot, eom
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = False
    rstrip: frozenset[int] = frozenset()  # specials that swallow the whitespace after them (llama.cpp's Phi-3 rule)


class _Meta:
    """Typed access to the metadata dict; every failure names the key and the file."""

    def __init__(self, metadata: Mapping[str, Any], source: str):
        self.md, self.source = metadata, source

    def fail(self, key: str, message: str) -> CheckpointError:
        return CheckpointError(f"{key}: {message}", file=self.source)

    def get(self, key: str, kind: type | tuple[type, ...], required: bool = False) -> Any:
        if key not in self.md:
            if required:
                raise self.fail(key, "missing; the GGUF has no usable tokenizer (re-convert it with llama.cpp's "
                                     "convert_hf_to_gguf.py)")
            return None
        value = self.md[key]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise self.fail(key, f"expected an integer, got {type(value).__name__}")
        if not isinstance(value, kind):
            raise self.fail(key, f"expected {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
        return value

    def array(self, key: str, item: type | tuple[type, ...], required: bool = False) -> list | None:
        if key not in self.md:
            if required:
                raise self.fail(key, "missing; the GGUF has no usable tokenizer")
            return None
        value = self.md[key]
        if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # a numpy array from a reader
            value = value.tolist()
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise self.fail(key, f"expected an array, got {type(value).__name__}")
        kinds = item if isinstance(item, tuple) else (item,)
        if not all(type(v) in kinds for v in value):  # the fast check; then find the culprit
            for i, v in enumerate(value):
                if not isinstance(v, item) or (item is int and isinstance(v, bool)):
                    raise self.fail(key, f"element {i} is {type(v).__name__} {v!r}; expected "
                                         f"{getattr(item, '__name__', 'a number')}")
        return list(value)


def read_vocab(metadata: Mapping[str, Any], source: str) -> GGUFVocab:
    """Check the `tokenizer.*` keys and apply llama.cpp's defaults. CheckpointError names a malformed key."""
    m = _Meta(metadata, source)
    model = m.get("tokenizer.ggml.model", str, required=True)
    if model not in MODELS:
        raise ConfigError(f"{source}: tokenizer.ggml.model {model!r} is not supported; sluice reads "
                          f"{', '.join(MODELS)} (byte-level BPE and SentencePiece BPE vocabularies)")
    tokens = m.array("tokenizer.ggml.tokens", str, required=True)
    n = len(tokens)
    if n == 0:
        raise m.fail("tokenizer.ggml.tokens", "the vocabulary is empty")
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # as llama.cpp renames empty tokens
    ids = {t: i for i, t in enumerate(tokens)}
    if len(ids) != n:
        seen: dict[str, int] = {}
        for i, t in enumerate(tokens):
            if seen.setdefault(t, i) != i:
                raise m.fail("tokenizer.ggml.tokens", f"token {t!r} appears twice (ids {seen[t]} and {i})")

    def same_length(key: str, values: list | None, fill: Any) -> list:
        if values is None:
            return [fill] * n
        if len(values) != n:
            raise m.fail(key, f"holds {len(values)} values for {n} tokens")
        return values

    types = list(same_length("tokenizer.ggml.token_type", m.array("tokenizer.ggml.token_type", int), NORMAL))
    if model == "gpt2" or "tokenizer.ggml.scores" not in metadata:
        scores = [0.0] * n
    else:
        import numpy as np  # float32, as llama.cpp stores scores (ints above 2**24 round the same way)

        raw = same_length("tokenizer.ggml.scores", m.array("tokenizer.ggml.scores", (int, float)), 0.0)
        scores = np.asarray(raw, dtype=np.float32).tolist()
    for i, t in enumerate(tokens):
        if t in _EOG_TEXTS or t in _FIM_TEXTS:
            types[i] = CONTROL

    pre_name, pre = _pre_tokenizer(m, model)
    merges = _read_merges(m) if model == "gpt2" else []
    vocab = GGUFVocab(model, pre_name, tokens, types, scores, merges, ids)

    # llama.cpp's per-model defaults: SentencePiece <unk>=0 <s>=1 </s>=2, adds bos and a prefix space; byte-level
    # BPE defaults bos/eos to id 11, which sluice does not copy: a file that relies on it is refused below.
    spm = model == "llama"
    defaults = {"bos": 1, "eos": 2, "unk": 0} if spm else {}
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                      ("pad", "padding_token_id"), ("sep", "seperator_token_id"), ("mask", "mask_token_id"),
                      ("eot", "eot_token_id"), ("eom", "eom_token_id")):
        full = f"tokenizer.ggml.{key}"
        tid = m.get(full, int)
        if tid is None:
            tid = defaults.get(name)
            tid = tid if tid is not None and tid < n else None
        elif not 0 <= tid < n:
            raise m.fail(full, f"id {tid} is outside the vocabulary of {n} tokens")
        vocab.special[name] = tid
    vocab.add_bos = _flag(m, "tokenizer.ggml.add_bos_token", spm or (pre is not None and pre.add_bos))
    vocab.add_eos = _flag(m, "tokenizer.ggml.add_eos_token", False)
    vocab.add_space_prefix = spm and _flag(m, "tokenizer.ggml.add_space_prefix", True)
    vocab.rstrip = _phi3_rstrip(metadata, vocab)
    for flag, name in ((vocab.add_bos, "bos"), (vocab.add_eos, "eos")):
        if flag and vocab.special[name] is None:
            raise m.fail(f"tokenizer.ggml.add_{name}_token", f"is true but tokenizer.ggml.{name}_token_id is not set")
    return vocab


def _phi3_rstrip(metadata: Mapping[str, Any], vocab: GGUFVocab) -> frozenset[int]:
    """llama.cpp recognises Phi-3 by `general.name` and makes its special tokens (and </s>) eat the whitespace that
    follows them, <unk> <s> <|endoftext|> excepted (llama-vocab.cpp, "set attributes by model name")."""
    name = metadata.get("general.name")
    if not isinstance(name, str) or not ("phi-3" in name.lower() or "phi3" in name.lower()):
        return frozenset()
    ids = {i for i, kind in enumerate(vocab.types) if kind in _MATCHED_WHOLE}
    ids |= {vocab.ids["</s>"]} if "</s>" in vocab.ids else set()
    return frozenset(ids - {vocab.ids.get(t) for t in ("<unk>", "<s>", "<|endoftext|>")})


def _flag(m: _Meta, key: str, default: bool) -> bool:
    value = m.get(key, bool)
    return default if value is None else value


def _pre_tokenizer(m: _Meta, model: str) -> tuple[str | None, PreTokenizer | None]:
    if model != "gpt2":
        return None, None
    name = m.get("tokenizer.ggml.pre", str)
    if not name:  # llama.cpp: a missing pre-tokenizer means "default" (and warns that quality will suffer)
        return "default", _DEFAULT
    if name not in PRE_TOKENIZERS:
        raise ConfigError(f"{m.source}: tokenizer.ggml.pre {name!r} is not a pre-tokenizer sluice knows; known: "
                          f"{', '.join(sorted(PRE_TOKENIZERS))}")
    return name, PRE_TOKENIZERS[name]


def _read_merges(m: _Meta) -> list[tuple[str, str]]:
    """`tokenizer.ggml.merges` as pairs, rank order, a repeated merge at its first rank (as llama.cpp keeps it).
    That the pairs name tokens is checked when the BPE model is built (see `_bpe_model`)."""
    key = "tokenizer.ggml.merges"
    pairs = []
    for i, merge in enumerate(dict.fromkeys(m.array(key, str, required=True))):
        a, space, b = merge.partition(" ")
        if not a:  # llama.cpp splits at the first space after the first character
            cut = merge.find(" ", 1)
            a, space, b = (merge[:cut], " ", merge[cut + 1:]) if cut > 0 else ("", "", "")
        if not space:
            raise m.fail(key, f"merge {i} {merge!r} is not two tokens separated by a space")
        pairs.append((a, b))
    return pairs


def _bpe_model(vocab: GGUFVocab, pre: PreTokenizer, source: str) -> models.BPE:
    try:
        return models.BPE(vocab=vocab.ids, merges=vocab.merges, unk_token=None, fuse_unk=False, byte_fallback=False,
                          ignore_merges=pre.ignore_merges)
    except Exception as e:  # tokenizers refuses merges that name unknown tokens; say which merge
        for i, (a, b) in enumerate(vocab.merges):
            for part in (a, b, a + b):
                if part not in vocab.ids:
                    raise CheckpointError(f"tokenizer.ggml.merges: merge {i} {a + ' ' + b!r} uses {part!r}, which is "
                                          "not in tokenizer.ggml.tokens", file=source) from e
        raise CheckpointError(f"tokenizer.ggml.merges: {e}", file=source) from e


def _chat_template(metadata: Mapping[str, Any], m: _Meta) -> str | dict[str, str] | None:
    """`tokenizer.chat_template`, plus the named ones gguf writes as `tokenizer.chat_template.<name>`."""
    default = m.get("tokenizer.chat_template", str)
    names = m.array("tokenizer.chat_templates", str) or []
    named = {name: m.get(f"tokenizer.chat_template.{name}", str, required=True) for name in names}
    if not named:
        return default
    return {**({"default": default} if default is not None else {}), **named}


# ---- the tokenizer -------------------------------------------------------------------------------------------------
class GGUFTokenizer(Tokenizer):
    """A sluice Tokenizer whose encode() and decode() follow llama.cpp on a GGUF's vocabulary."""

    def __init__(self, vocab: GGUFVocab, backend: _Backend, config: Mapping[str, Any],
                 chat_template: str | dict[str, str] | None, source: str):
        super().__init__(backend, config, chat_template, source)
        self.vocab = vocab
        # longest first, as llama.cpp partitions (its sort leaves equal lengths in no set order; two specials of
        # one length overlapping in a text is the only case where that order would show)
        self._specials = sorted(((t, i) for i, t in enumerate(vocab.tokens) if vocab.types[i] in _MATCHED_WHOLE),
                                key=lambda ti: (-len(ti[0]), ti[1]))

    # ---- encode --------------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`, as llama.cpp's `llama_tokenize(text, add_special, parse_special=True)`."""
        if not isinstance(text, str):
            raise RequestError(f"text to encode must be a string, got {type(text).__name__}")
        check_text(text)  # (the BPE backend raised a TypeError for one, the SentencePiece path encoded its bytes)
        v = self.vocab
        out: list[int] = [v.special["bos"]] if add_special_tokens and v.add_bos else []
        prev_special = True  # SentencePiece prefixes a space to text that opens the prompt or follows a special
        for frag in self._partition(text):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
            elif v.model == "gpt2":
                out += self.backend.encode(frag, add_special_tokens=False).ids
            else:
                out += self._spm_encode((" " if v.add_space_prefix and prev_special else "") + frag)
                prev_special = False
        if add_special_tokens and v.add_eos:
            out.append(v.special["eos"])
        return out

    def _partition(self, text: str) -> list[str | int]:
        """`text` cut into plain-text pieces and special-token ids, each special's occurrences taken left to
        right, longest special first (llama.cpp's tokenizer_st_partition)."""
        frags: list[str | int] = [text] if text else []
        for token, tid in self._specials:
            if token not in text:
                continue
            rstrip = tid in self.vocab.rstrip
            cut: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or token not in frag:
                    cut.append(frag)
                    continue
                for k, part in enumerate(frag.split(token)):
                    if k:
                        cut.append(tid)
                        part = part.lstrip(" \t\n\v\f\r") if rstrip else part  # C isspace()
                    if part:
                        cut.append(part)
            frags = cut
        return frags

    def _spm_encode(self, text: str) -> list[int]:
        """llama.cpp's SentencePiece BPE (llm_tokenizer_spm_session) over one piece of plain text."""
        v = self.vocab
        text = text.replace(" ", "\u2581")
        n = len(text)
        if n == 0:
            return []
        # symbol i covers text[i : i + size[i]]; merging absorbs the right neighbour, so symbols never move
        size, nxt, prev = [1] * n, [*range(1, n), -1], [*range(-1, n - 1)]
        heap: list[tuple[float, int, int, int]] = []  # (-score, left, right, merged size): best score, then leftmost

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            merged = size[left] + size[right]
            tid = v.ids.get(text[left:left + merged])
            if tid is not None:
                heapq.heappush(heap, (-v.scores[tid], left, right, merged))

        for i in range(1, n):
            push(i - 1, i)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != merged:
                continue  # a side was merged since this pair was queued
            size[left], size[right] = merged, 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])
        out: list[int] = []
        i = 0
        while i != -1:
            piece = text[i:i + size[i]]
            tid = v.ids.get(piece)
            if tid is not None:
                out.append(tid)
            else:  # not a token: its UTF-8 bytes as <0xXX> tokens
                out += [self._byte_ids[b] for b in piece.encode("utf-8", "surrogatepass")]
            i = nxt[i]
        return out

    @cached_property
    def _byte_ids(self) -> list[int]:
        """Id of the token for each byte: <0xXX>, else the one-character token, else unk (llama.cpp fails here)."""
        v, out = self.vocab, []
        for b in range(256):
            tid = v.ids.get(f"<0x{b:02X}>", v.ids.get(chr(b)) if b < 0x80 else None)
            if tid is None:
                tid = v.special["unk"]
            if tid is None:
                raise RequestError(f"model {self.source}: the vocabulary has no token for byte 0x{b:02X} and no "
                                   "unknown token, so this text cannot be encoded")
            out.append(tid)
        return out

    # ---- decode --------------------------------------------------------------------------------------------------
    @cached_property
    def _pieces(self) -> list[bytes]:
        """Bytes each id renders to (llama.cpp's token_to_piece with special=True)."""
        v, out = self.vocab, []
        for t, kind in zip(v.tokens, v.types):
            if kind == NORMAL and v.model == "gpt2":
                out.append(bytes(_BYTE_OF_CHAR[c] for c in t) if all(c in _BYTE_OF_CHAR for c in t)
                           else t.encode("utf-8", "surrogatepass"))
            elif kind == NORMAL:
                out.append(t.replace("\u2581", " ").encode("utf-8", "surrogatepass"))
            elif kind == BYTE and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                out.append(bytes([int(t[3:5], 16)]))
            elif kind in (CONTROL, USER_DEFINED, UNKNOWN, BYTE):
                out.append(t.encode("utf-8", "surrogatepass"))
            else:  # UNUSED / UNDEFINED render as nothing
                out.append(b"")
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for `ids`; invalid UTF-8 decodes to U+FFFD. Ids outside the vocabulary are skipped (as
        transformers does: a model's embedding may be wider than its vocabulary)."""
        v, pieces, n = self.vocab, self._pieces, len(self.vocab.tokens)
        out = bytearray()
        for k, tid in enumerate(ids):
            tid = int(tid)
            if not 0 <= tid < n or (skip_special_tokens and v.types[tid] in _SKIPPED):
                continue
            piece = pieces[tid]
            # llama.cpp strips the prefix space of the first token only, and not when that token is bos
            if k == 0 and v.add_space_prefix and piece.startswith(b" "):
                piece = piece[1:]
            out += piece
        return out.decode("utf-8", "replace")

    # ---- ids -----------------------------------------------------------------------------------------------------
    @property
    def bos_token_id(self) -> int | None:
        return self.vocab.special["bos"]

    @property
    def eos_token_id(self) -> int | None:
        return self.vocab.special["eos"]

    @property
    def pad_token_id(self) -> int | None:
        return self.vocab.special["pad"]

    @cached_property
    def eog_token_ids(self) -> frozenset[int]:
        """Ids llama.cpp ends generation on: eos, eot, eom and the end/fim-marker tokens it recognises by text."""
        v = self.vocab
        ids = {v.special[k] for k in ("eos", "eot", "eom") if v.special[k] is not None}
        ids.update(i for i, t in enumerate(v.tokens) if t in _EOG_TEXTS or t in _FIM_EOG_TEXTS)
        return frozenset(ids)


def tokenizer_from_gguf(metadata: Mapping[str, Any], source: str) -> GGUFTokenizer:
    """The tokenizer described by a GGUF's metadata (`key -> value`, arrays as lists), named `source` in errors.

    Same interface as `Tokenizer.from_folder`; encode() gives the ids llama.cpp gives with parse_special=True.
    Raises CheckpointError naming the key for missing or malformed tokenizer metadata, ConfigError for a
    tokenizer model or pre-tokenizer sluice does not implement.
    """
    vocab = read_vocab(metadata, source)
    if vocab.model == "gpt2":
        pre = PRE_TOKENIZERS[vocab.pre] if vocab.pre else _DEFAULT
        backend = _Backend(_bpe_model(vocab, pre, source))
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        backend.decoder = decoders.ByteLevel()
    else:  # encode() runs SentencePiece in Python; the backend only maps ids and strings
        backend = _Backend(models.BPE(vocab=vocab.ids, merges=[], unk_token=None))
    tokens = vocab.tokens
    config: dict[str, Any] = {f"{name}_token": tokens[tid] for name, tid in vocab.special.items()
                              if tid is not None and name in ("bos", "eos", "unk", "pad", "sep", "mask")}
    config["add_bos_token"] = vocab.add_bos
    return GGUFTokenizer(vocab, backend, config, _chat_template(metadata, _Meta(metadata, source)), source)
