"""StreamingExpertStore: a budgeted cache of expert slots over all layers, filled from disk on demand.

Slot buffers are allocated once at load (one stack per projection, in the checkpoint's dtype) and written in place
by the reader; one LRU over (layer, expert) is shared by all layers; the experts of the current acquire are pinned
so a later miss in the same pass can never evict them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Sequence

import torch

from ..checkpoint.ref import DTYPES
from .base import ExpertBatch
from .budget import BudgetPlan, plan_budget
from .layout import ExpertLayout
from .resident import expert_requests


class StreamingExpertStore:
    """`slots` expert slots; misses are read by `reader` straight into the slot buffers."""

    def __init__(self, layout: ExpertLayout, reader, slots: int, plan: BudgetPlan | None = None):
        s = layout.spec
        self.layout, self.reader, self.plan = layout, reader, plan
        self.n_slots = slots
        self.max_batch = slots
        raw = DTYPES[layout.dtype][1]
        # The only large allocation of the store: written in place for the whole run.
        # zeros, not empty: first-touch page faults happen here at load, not inside timed decode steps
        self.gate_up = torch.zeros((slots, *layout.gate_up_shape), dtype=raw)  # [S, 2I, H]
        self.down = torch.zeros((slots, *layout.down_shape), dtype=raw)  # [S, H, I]
        self._lru: OrderedDict[tuple[int, int], int] = OrderedDict()  # (layer, expert) -> slot, oldest first
        self._owner: list[tuple[int, int] | None] = [None] * slots
        self._free = list(range(slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self.usage = torch.zeros((s.n_layers, s.num_experts), dtype=torch.int64)  # routing counts
        self.hits = self.misses = self.evictions = self.bytes_read = 0
        self.io_wait_s = 0.0

    @classmethod
    def with_budget(cls, layout: ExpertLayout, reader, expert_budget: int, memory: int) -> "StreamingExpertStore":
        """As many slots as `memory` leaves after the resident weights (`memory - expert_budget`); BudgetError
        (with the smallest budget that works) when fewer than top_k slots fit."""
        s = layout.spec
        plan = plan_budget(memory, memory - expert_budget, layout.expert_nbytes, s.top_k,
                           len(layout.layers) * s.num_experts)
        return cls(layout, reader, plan.slots, plan)

    @property
    def nbytes(self) -> int:
        return self.gate_up.numel() * self.gate_up.element_size() + self.down.numel() * self.down.element_size()

    def _victim(self) -> int:
        if self._free:
            return self._free.pop()
        for key, slot in self._lru.items():  # oldest first
            if slot not in self._pinned:
                del self._lru[key]
                self._owner[slot] = None
                self.evictions += 1
                return slot
        raise RuntimeError("all expert slots are pinned")  # unreachable: acquire asks for <= max_batch experts

    def acquire(self, layer: int, experts: Sequence[int]) -> ExpertBatch:
        """Pin `experts` of `layer` in slots, reading the misses (all at once, sorted by the reader)."""
        if len(experts) > self.max_batch:
            raise ValueError(f"acquire of {len(experts)} experts > {self.max_batch} slots")
        self.usage[layer, list(experts)] += 1
        slots: list[int] = []
        requests = []
        for e in experts:
            key = (layer, e)
            slot = self._lru.get(key)
            if slot is not None:
                self._lru.move_to_end(key)
                self.hits += 1
            else:
                slot = self._victim()
                self._lru[key] = slot
                self._owner[slot] = key
                requests += expert_requests(self.layout, layer, e, self.gate_up[slot], self.down[slot])
                self.misses += 1
            self._pinned.add(slot)
            slots.append(slot)
        if requests:
            t0 = time.perf_counter()
            try:
                self.reader.read(requests)
            except BaseException:
                # the slots of this batch may hold partial bytes: forget them so no later step trusts them
                self._forget(layer, experts)
                raise
            self.io_wait_s += time.perf_counter() - t0
            self.bytes_read += sum(r.nbytes for r, _ in requests)
        return ExpertBatch(self.gate_up, self.down, slots)

    def _forget(self, layer: int, experts: Sequence[int]) -> None:
        for e in experts:
            slot = self._lru.pop((layer, e), None)
            if slot is not None:
                self._owner[slot] = None
                self._free.append(slot)
        self._pinned.clear()

    def release(self, layer: int) -> None:
        self._pinned.clear()

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        pass  # TODO(issue 6): predicted experts read in the background into free / LRU slots

    def stats(self) -> dict:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "bytes_read": self.bytes_read,
            "io_wait_s": round(self.io_wait_s, 6),
            "slots": self.n_slots,
            "slot_bytes": self.nbytes,
        }

    def close(self) -> None:
        pass
