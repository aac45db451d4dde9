"""ResidentExpertStore: every expert of every MoE layer loaded once at start-up (no budget, no eviction).

It reads the same byte ranges through the same reader interface as the streaming store, so both layouts and every
reader are exercised by resident runs too; slots are simply the expert ids of each layer's stacks.
"""

from __future__ import annotations

from typing import Sequence

import torch
from tqdm import tqdm

from ..checkpoint.ref import DTYPES
from .base import ExpertBatch
from .layout import ExpertLayout


def expert_requests(layout: ExpertLayout, layer: int, expert: int, gate_up: torch.Tensor, down: torch.Tensor):
    """(ReadRange, destination) pairs that fill one expert's slot views gate_up [2I, H] and down [H, I]."""
    bufs = {"gate_up": gate_up.view(-1).view(torch.uint8), "down": down.view(-1).view(torch.uint8)}
    return [
        (part.range, bufs[part.proj][part.dest_offset : part.dest_offset + part.range.nbytes])
        for part in layout.parts(layer, expert)
    ]


class ResidentExpertStore:
    """All experts resident, stacked per layer as gate_up [E, 2I, H] and down [E, H, I] in the compute dtype."""

    def __init__(self, layout: ExpertLayout, reader, dtype: torch.dtype, progress: bool = False):
        s = layout.spec
        self.max_batch = s.num_experts
        self.layout = layout
        raw_dtype = DTYPES[layout.dtype][1]
        self.gate_up: dict[int, torch.Tensor] = {}
        self.down: dict[int, torch.Tensor] = {}
        self.bytes_read = 0
        self.requests = 0
        self.usage = torch.zeros((s.n_layers, s.num_experts), dtype=torch.int64)  # routing counts
        for layer in tqdm(layout.layers, desc="loading experts", unit="layer", disable=not progress, leave=False):
            gu = torch.empty((s.num_experts, *layout.gate_up_shape), dtype=raw_dtype)
            dn = torch.empty((s.num_experts, *layout.down_shape), dtype=raw_dtype)
            reqs = []
            for e in range(s.num_experts):
                reqs += expert_requests(layout, layer, e, gu[e], dn[e])
            reader.read(reqs)
            self.bytes_read += sum(r.nbytes for r, _ in reqs)
            self.gate_up[layer] = gu.to(dtype)
            self.down[layer] = dn.to(dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.gate_up, self.down) for t in d.values())

    def acquire(self, layer: int, experts: Sequence[int]) -> ExpertBatch:
        self.requests += len(experts)
        self.usage[layer, list(experts)] += 1
        return ExpertBatch(self.gate_up[layer], self.down[layer], list(experts))

    def release(self, layer: int) -> None:
        pass

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        pass

    def prefetch_next(self, layer: int, experts: Sequence[int]) -> None:
        pass

    def stats(self) -> dict:
        return {"hits": self.requests, "misses": 0, "load_bytes_read": self.bytes_read}

    def close(self) -> None:
        pass
