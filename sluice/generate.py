"""The generation loop, top to bottom: prefill the prompt in chunks, then decode one token at a time and sample.

`generate_step` is the one loop (a generator of token ids, the mlx-lm shape): `Model.generate_tokens` samples with
it, `Model.replay` teacher-forces with it (a "sampler" that records the argmax and returns the recorded token).
`TextStream` turns any stream of token ids into text pieces, with stop strings and a cancellation check after every
token: `Model.generate` and the server's jobs read text through it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from .models.model import Transformer
from .quant.native import pool
from .sampling import LogitsProcessor, Sampler, apply_logits_processors
from .tokenizer import StopMatcher


@dataclass
class StepTimes:
    """Wall-clock split of one generation: prefill (whole prompt, with the first token's logits) and each decode
    step (one forward pass and its sampling); `Model.step_times` holds the last generation's."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: list[float] = field(default_factory=list)


@dataclass
class PromptMemo:
    """The last prompt a generate_step prefilled and the hidden state [1, H] of its last position. A request that
    repeats that prompt exactly, its positions still in the KV cache, starts from this hidden state instead of
    re-running the prompt's last token alone: on a quantized model a single token runs the integer kernels, whose
    bits differ from the prefill's, so a seeded request would not repeat (its first token already differed)."""

    ids: list[int] = field(default_factory=list)
    hidden: torch.Tensor | None = None


#: a prompt's length -> a context manager giving the tokens per pass it runs with while it holds borrowed memory
#: (engine.Model._widened: a streamed prompt borrows expert slots, store/budget.py PromptLoan)
Widen = Callable[[int], AbstractContextManager[int]]


def prefill(model: Transformer, tokens: Sequence[int], pos: int, chunk: int,
            between: Callable[[], object] | None = None, span: int = 0, widen: Widen | None = None) -> torch.Tensor:
    """Run `tokens` from position `pos` in chunks of `chunk`; return the last position's hidden state [1, H].
    span > chunk: up to `span` tokens at a time go layer by layer over their chunks (Transformer.forward_layers: a
    streamed layer's experts read once for them, not once a chunk; the same bits). `between` is called before each
    chunk, or each layer (the thread governor's tick). The native prompt calls' kept scratch (up to ~10 MB at 2,048
    tokens) goes back after the prompt. `widen`: see passes."""
    hidden = None
    for part in passes(model, tokens, pos, chunk, between, span, widen):
        hidden = part[-1]
    assert hidden is not None, "prefill needs at least one token"
    return hidden[-1:]


def passes(model: Transformer, tokens: Sequence[int], pos: int, chunk: int,
           between: Callable[[], object] | None = None, span: int = 0,
           widen: Widen | None = None) -> Iterator[list[torch.Tensor]]:
    """prefill's work, one span (or chunk) at a time: the final-norm hidden states of its chunks ([t, H] each).
    `widen` (or None): given the prompt's length, the context in which it runs and the chunk it runs with there
    (longer passes in borrowed memory, given back when the prompt is done)."""
    ids = torch.tensor(list(tokens), dtype=torch.long)
    with widen(len(ids)) if widen is not None else nullcontext(chunk) as chunk:
        span = max(span, chunk)
        try:
            for s0 in range(0, len(ids), span):
                part = ids[s0 : s0 + span]
                if len(part) > chunk:
                    yield model.forward_layers(part, pos + s0, chunk, between)
                    continue
                if between is not None:
                    between()
                yield [model.forward(part, pos + s0)]
        finally:
            pool.release_scratch()


def decode_one(model: Transformer, token: int, pos: int) -> torch.Tensor:
    """One token at position `pos` -> its hidden state [1, H]."""
    return model.forward(torch.tensor([token], dtype=torch.long), pos)


def generate_step(
    model: Transformer,
    prompt: Sequence[int],
    sampler: Sampler,
    processors: Sequence[LogitsProcessor] = (),
    max_tokens: int = 256,
    start_pos: int = 0,
    prefill_chunk: int = 256,
    prefill_span: int = 0,
    times: StepTimes | None = None,
    between: Callable[[], object] | None = None,
    memo: PromptMemo | None = None,
    widen: Widen | None = None,
) -> Iterator[int]:
    """Yield up to `max_tokens` sampled ids after `prompt` (positions from `start_pos`; the KV cache before it is
    reused as is). A yielded id is fed back only when the next one is asked for, so after n ids the cache holds
    len(prompt) + n - 1 positions. The caller stops early by closing the generator. `between` is called before
    every forward pass (the thread governor's tick: outside the timed steps, except inside the prefill's). `memo`:
    the caller's PromptMemo, used when prompt is its prompt and start_pos says the cache holds all but the last
    position (then nothing is prefilled), else cleared before the prefill writes the cache and set after it. `widen`:
    the prefill's (passes)."""
    times = times if times is not None else StepTimes()
    history = list(prompt)
    t0 = time.perf_counter()
    if memo is not None and memo.hidden is not None and start_pos >= len(prompt) - 1 and memo.ids == history:
        hidden, start_pos = memo.hidden, len(prompt)
    else:
        if memo is not None:
            memo.ids, memo.hidden = [], None
        hidden = prefill(model, prompt[start_pos:], start_pos, prefill_chunk, between, prefill_span, widen)
        if memo is not None:
            memo.ids, memo.hidden = history.copy(), hidden
    pos = len(prompt)
    times.prefill_tokens = len(prompt) - start_pos
    for i in range(max_tokens):
        logits = model.logits(hidden)[0]  # [V] float32
        logits = apply_logits_processors(processors, history, logits)
        token = sampler(logits)
        now = time.perf_counter()
        if i == 0:
            times.prefill_s = now - t0
        else:
            times.decode_s.append(now - t0)
        yield token
        history.append(token)
        if i + 1 == max_tokens:
            break
        if between is not None:
            between()
        t0 = time.perf_counter()
        hidden = decode_one(model, token, pos)
        pos += 1


class Teacher:
    """A sampler for teacher forcing: records the greedy argmax of every logits row it sees (`argmax`) and returns
    the recorded `tokens` in order, so `generate_step` feeds them whatever the model would pick. Past the recorded
    tokens it returns the argmax (the last step's logits are only read, never fed)."""

    def __init__(self, tokens: Sequence[int]):
        self.tokens = list(tokens)
        self.argmax: list[int] = []

    def __call__(self, logits: torch.Tensor) -> int:
        self.argmax.append(int(logits.argmax()))
        i = len(self.argmax) - 1
        return self.tokens[i] if i < len(self.tokens) else self.argmax[-1]


class TextStream:
    """Token ids -> text pieces: incremental detokenization, stop strings cut (the stop text is never yielded), and
    `cancelled()` polled after every token (text pieces skip tokens that decode to nothing, so a check per piece
    would come late).

    Iterate it once. When the iteration ends, `completion_tokens` counts the ids taken from `tokens` and
    `finish_reason` says why it ended: "stop" (a stop string, or `tokens` ended before `limit` ids: EOS), "length"
    (`limit` ids) or "cancelled". However it ends (a stop, cancellation, the consumer closing it, an error),
    `tokens` is closed at once, so the model's loop stops and keeps its KV bookkeeping consistent.
    """

    def __init__(self, tokens: Iterator[int], decoder, limit: int, stop: Sequence[str] | str | None = None,
                 cancelled: Callable[[], bool] | None = None):
        """`decoder`: `add(id) -> str` and `flush() -> str` (Tokenizer.stream_decoder()); `limit`: the most ids
        `tokens` yields (its max_tokens)."""
        self.tokens, self.decoder, self.limit = tokens, decoder, limit
        self.matcher = StopMatcher(stop) if stop else None
        self.cancelled = cancelled
        self.completion_tokens = 0
        self.finish_reason: str | None = None

    def _cut(self, text: str) -> tuple[str, bool]:
        return self.matcher.feed(text) if self.matcher is not None else (text, False)

    def __iter__(self) -> Iterator[str]:
        try:
            if self.cancelled is not None and self.cancelled():  # e.g. the client left while the job waited
                self.finish_reason = "cancelled"
                return
            for token in self.tokens:
                self.completion_tokens += 1
                piece, stopped = self._cut(self.decoder.add(token))
                if piece:
                    yield piece
                if stopped:
                    self.finish_reason = "stop"
                    return
                if self.cancelled is not None and self.cancelled():
                    self.finish_reason = "cancelled"
                    return
            piece, stopped = self._cut(self.decoder.flush())
            if piece:
                yield piece
            if not stopped and self.matcher is not None and (rest := self.matcher.flush()):
                yield rest
            self.finish_reason = "length" if stopped is False and self.completion_tokens >= self.limit else "stop"
        finally:
            close = getattr(self.tokens, "close", None)
            if close is not None:
                close()
