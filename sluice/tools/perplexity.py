"""Perplexity of a model on a text: exp(mean negative log-likelihood of the scored tokens), with the windows defined
as llama.cpp's `llama-perplexity` defines them, so the numbers compare with llama.cpp's on the same file.

Default (llama.cpp, `tools/perplexity/perplexity.cpp`): the text is tokenized whole (a BOS in front when the
tokenizer adds one), cut into floor(N / C) non-overlapping windows of C = --context tokens (the ragged tail is
dropped); each window is evaluated from an empty cache, its first token replaced by BOS when the tokenizer adds one,
and only its second half is scored: the logits at positions C/2 .. C-2 predicting tokens C/2+1 .. C-1, so every
scored token has at least C/2 tokens of context. C - 1 - C/2 tokens are scored per window.

With --stride S (the sliding window of transformers' perplexity guide): windows of C tokens start every S tokens;
each scores the tokens no earlier window scored (the first window all but its first token), so with S < C every
token but the first is scored once, with up to C - S tokens of context beyond the new ones. Numbers differ from the
default.

log-softmax is computed in float64 from the float32 logits (llama.cpp sums exp in double too).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class Window:
    """Feed tokens[start:end]; score tokens[first:end] (each from the logits one position before it)."""

    start: int
    end: int
    first: int


@dataclass
class Perplexity:
    """The result: perplexity = exp(nll / tokens)."""

    nll: float  # sum of -log p(token) over the scored tokens, natural log
    tokens: int  # tokens scored
    windows: int
    context: int
    stride: int | None  # None: llama.cpp's non-overlapping windows

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    def as_dict(self) -> dict:
        return {"perplexity": self.perplexity, "nll_per_token": self.nll / self.tokens, "tokens_scored": self.tokens,
                "windows": self.windows, "context": self.context, "stride": self.stride,
                "definition": "llama.cpp" if self.stride is None else "sliding"}


def check_windows(context: int, stride: int | None = None) -> None:
    """ConfigError unless windows of `context` tokens (every `stride`) score at least one token each."""
    if context < 2:
        raise ConfigError(f"--context {context}: a window needs at least 2 tokens")
    if stride is None and context < 3:  # C - 1 - C/2 tokens scored per window: none at C = 2 (was a ZeroDivisionError)
        raise ConfigError(f"--context {context}: llama.cpp's windows score only their second half, which a window "
                          "of 2 tokens does not have; give --context 3 or more, or --stride")
    if stride is not None and not 1 <= stride <= context:
        raise ConfigError(f"--stride {stride}: must be between 1 and --context ({context})")


def windows(n_tokens: int, context: int, stride: int | None = None) -> list[Window]:
    """The windows over a text of `n_tokens` tokens (see the module doc). ConfigError when there are none."""
    check_windows(context, stride)
    if stride is None:
        if n_tokens < context:
            raise ConfigError(f"the text is {n_tokens} tokens, shorter than one window of --context {context}: give a "
                              "longer text or a smaller --context")
        return [Window(i * context, (i + 1) * context, i * context + context // 2 + 1)
                for i in range(n_tokens // context)]
    if n_tokens < 2:
        raise ConfigError(f"the text is {n_tokens} token(s): at least 2 are needed to score one")
    out, scored_to = [], 1  # token 0 has no prediction
    for begin in range(0, n_tokens, stride):
        end, first = min(begin + context, n_tokens), max(scored_to, begin + 1)
        if end > first:  # (stride == context: a window's first token has no prediction, as in transformers' guide)
            out.append(Window(begin, end, first))
            scored_to = end
        if end == n_tokens:
            break
    return out


def nll(logits: torch.Tensor, targets: Sequence[int]) -> float:
    """Sum of -log softmax(logits)[target] over rows (logits [T, V] float32, T targets), in float64."""
    lp = torch.log_softmax(logits.to(torch.float64), dim=-1)  # [T, V]
    return -float(lp[torch.arange(len(targets)), torch.tensor(list(targets), dtype=torch.long)].sum())


def bos_of(encode: Callable[[str, bool], list[int]]) -> int | None:
    """The BOS id the tokenizer puts in front of a text (encode(text, add_special_tokens)), or None if it adds none."""
    plain, special = encode("a", False), encode("a", True)
    lead = special[: len(special) - len(plain)]
    return lead[0] if len(lead) == 1 and special[len(lead):] == plain else None


def perplexity(logits: Callable[[list[int]], torch.Tensor], tokens: Sequence[int], context: int,
               stride: int | None = None, bos: int | None = None,
               progress: Callable[[Perplexity], None] | None = None) -> Perplexity:
    """Perplexity of `tokens` under `logits(ids) -> [len(ids), V]` (a fresh pass per window).

    `bos`: llama.cpp's default mode replaces each window's first token with it (pass the tokenizer's BOS when it adds
    one; see bos_of). `progress(result so far)` is called after each window."""
    tokens = list(tokens)
    ws = windows(len(tokens), context, stride)
    res = Perplexity(0.0, 0, 0, context, stride)
    for w in ws:
        ids = tokens[w.start:w.end]
        if stride is None and bos is not None:
            ids[0] = bos
        out = logits(ids)  # [len(ids), V]
        rows = out[w.first - 1 - w.start : w.end - 1 - w.start]  # the logits at position p predict token p + 1
        res.nll += nll(rows, tokens[w.first:w.end])
        res.tokens += w.end - w.first
        res.windows += 1
        if progress is not None:
            progress(res)
    return res
