"""The seam between model math and expert bytes: models ask for experts by (layer, ids) and get slot views.

A store hands out `ExpertBatch`es: the slot stacks (allocated once) and, for each requested expert, the slot index
that holds it. The MoE math indexes the stacks in place (no per-step stack/cat of weights). The resident store's
slots are simply all experts of the layer; the streaming store's are a budgeted LRU cache over all layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from .layout import ExpertFormat, ExpertLayout


@dataclass
class ExpertBatch:
    """Weights of a set of experts of one layer, as views into slot stacks.

    raw: uint8 [S, slot bytes], each slot one expert as stored (layout.ExpertFormat `format` says where gate, up and
    down are and in which format). When the layer's experts are plain (BF16/F16/F32), gate_up [S, 2I, H] (gate rows
    first, then up) and down [S, H, I] are typed views of the same slots (None otherwise). `slots[j]` holds the j-th
    requested expert. `pending[j]`, when present, blocks until slot j's bytes have landed: a streaming store returns
    as soon as its reads are queued, so the math can run the experts already in memory while the disk fills the
    others. Call `wait(j)` before touching slot j (`ready(j)` says whether it was waited for or never pending;
    `arrived(j)` also whether its bytes have landed since, `landed[j]` being the store's non-blocking check).
    packed: the resident store's bf16 experts in oneDNN's blocked layout instead of gate_up / down, per slot
    (gate_up [2I, H], down [H, I]; matmul.pack), computed with matmul.packed_linear.
    """

    gate_up: torch.Tensor | None
    down: torch.Tensor | None
    slots: list[int]
    pending: dict[int, Callable[[], None]] = field(default_factory=dict)
    raw: torch.Tensor | None = None
    format: "ExpertFormat | None" = None
    landed: dict[int, Callable[[], bool]] = field(default_factory=dict)
    packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def ready(self, j: int) -> bool:
        return j not in self.pending

    def arrived(self, j: int) -> bool:
        """Whether wait(j) would return at once: never pending, waited for, or its read has landed."""
        if j not in self.pending:
            return True
        done = self.landed.get(j)
        return done is not None and done()

    def wait(self, j: int) -> None:
        waiter = self.pending.pop(j, None)
        if waiter is not None:
            waiter()

    def wait_all(self) -> None:
        for j in sorted(self.pending):
            self.wait(j)


class ExpertStore(Protocol):
    """What the MoE block needs from whoever owns the expert weights."""

    #: the most experts one acquire() may hold pinned at once (the MoE block works in passes above it)
    max_batch: int
    #: where each expert's bytes are and how they are stored (layout.ExpertLayout): the MoE block reads each layer's
    #: format from it when it is built, to pick that format's math
    layout: "ExpertLayout"

    #: whether a prediction prefetch_next deferred waits to be issued (acquire(hold=True) kept it)
    deferred: bool

    def acquire(self, layer: int, experts: Sequence[int], hold: bool = False) -> ExpertBatch:
        """Pin `experts` (ascending ids) of `layer` until release(layer); their reads may still be in flight:
        batch.wait(j) before using slot j. Then issue the prediction prefetch_next deferred, unless `hold`: the
        caller then calls issue_deferred() before release (a decode block, with its experts' math under way:
        layers/moe_decode.py)."""
        ...

    def issue_deferred(self) -> None:
        """Issue a prediction acquire(hold=True) kept, if any."""
        ...

    def release(self, layer: int) -> None:
        """Unpin what the last acquire(layer) pinned (after any read of it still in flight has landed)."""
        ...

    def prefetch(self, layer: int, experts: Sequence[int], prompt: bool = False) -> None:
        """Advisory: these experts of `layer` will likely be needed soon. Never changes results. `prompt`: a
        prompt's read-ahead of the next layer (one read per expert, counted apart from decode's prefetch)."""
        ...

    def guessing(self) -> bool:
        """Whether a decode token's guess of the next layer's experts is wanted now (the model skips computing it
        while False: the store's throttle pauses the guesses)."""
        ...

    def prefetch_next(self, layer: int, experts: Sequence[int]) -> None:
        """prefetch, issued once the next acquire has pinned its experts (the model calls this between a layer's
        attention and its MoE block, with the next MoE layer's prediction)."""
        ...

    def stats(self) -> dict:
        """Counters: hits, misses, bytes_read, io_wait_s, ..."""
        ...

    def close(self) -> None:
        ...
