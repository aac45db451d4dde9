"""The generation loop, top to bottom: prefill the prompt in chunks, then decode one token at a time and sample.

`generate_step` is a generator of token ids (mlx-lm shape); text, stop strings and EOS handling sit on top of it
in `Model.generate`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .models.blocks import Transformer
from .sampling import LogitsProcessor, Sampler, apply_logits_processors


@dataclass
class StepTimes:
    """Wall-clock split of one generation: prefill (whole prompt) and each decode step."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: list[float] = field(default_factory=list)


def prefill(model: Transformer, tokens: Sequence[int], pos: int, chunk: int,
            between: Callable[[], object] | None = None) -> torch.Tensor:
    """Run `tokens` from position `pos` in chunks of `chunk`; return the last position's hidden state [1, H].
    `between` is called before each chunk (the thread governor's tick)."""
    ids = torch.tensor(list(tokens), dtype=torch.long)
    hidden = None
    for start in range(0, len(ids), chunk):
        if between is not None:
            between()
        hidden = model.forward(ids[start : start + chunk], pos + start)
    assert hidden is not None, "prefill needs at least one token"
    return hidden[-1:]


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
    times: StepTimes | None = None,
    between: Callable[[], object] | None = None,
) -> Iterator[int]:
    """Yield up to `max_tokens` sampled ids after `prompt` (positions from `start_pos`; the KV cache before it is
    reused as is). The caller stops early by closing the generator. `between` is called before every forward pass
    (the thread governor's tick: untimed, outside the steps)."""
    times = times if times is not None else StepTimes()
    history = list(prompt)
    t0 = time.perf_counter()
    hidden = prefill(model, prompt[start_pos:], start_pos, prefill_chunk, between)
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
