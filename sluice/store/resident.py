"""ResidentExpertStore: every expert of every MoE layer loaded once at start-up (no budget, no eviction).

It reads the same byte ranges through the same reader interface as the streaming store, so both layouts and every
reader are exercised by resident runs too; slots are simply the expert ids of each layer's stacks.
"""

from __future__ import annotations

from typing import Sequence

import torch
from tqdm import tqdm

from ..quant.matmul import pack, packable
from .base import ExpertBatch
from .layout import ExpertLayout
from .pages import page_rows


def expert_requests(layout: ExpertLayout, layer: int, expert: int, slot: torch.Tensor):
    """(ReadRange, destination) pairs that fill one expert's slot (uint8 [slot bytes]) with its stored bytes."""
    return [(part.range, slot[part.dest_offset : part.dest_offset + part.range.nbytes])
            for part in layout.parts(layer, expert)]


def typed_views(layout: ExpertLayout, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """gate_up [S, 2I, H] and down [S, H, I] viewing raw uint8 [S, slot bytes] in the experts' plain dtype, or
    (None, None) when the experts are stored quantized (the kernels read raw)."""
    dt = layout.plain_dtype
    if dt is None:
        return None, None
    S, item = raw.shape[0], torch.tensor([], dtype=dt).element_size()
    typed = raw.view(dt)  # [S, slot bytes / itemsize]
    fmt = layout.format(layout.layers[0]) if layout.layers else None
    gu_n = layout.gate_up_shape[0] * layout.gate_up_shape[1]
    dn_at = fmt.down_offset // item if fmt is not None else gu_n
    dn_n = layout.down_shape[0] * layout.down_shape[1]
    return typed[:, :gu_n].view(S, *layout.gate_up_shape), typed[:, dn_at : dn_at + dn_n].view(S, *layout.down_shape)


class ResidentExpertStore:
    """All experts resident. Plain experts are stacked per layer as gate_up [E, 2I, H] and down [E, H, I] in the
    compute dtype, or, at bf16 where matmul.packable holds (bf16 GEMMs on, F.linear's bits), kept per expert in
    oneDNN's blocked layout (packed: the same bytes, no per-call copy of the weights in the GEMMs); quantized experts
    stay in their stored bytes, raw [E, slot bytes] per layer (the kernels compute from them: a Q4_K model stays ~4.5
    bits per weight in memory)."""

    def __init__(self, layout: ExpertLayout, reader, dtype: torch.dtype, progress: bool = False,
                 bf16_gemm: bool = False):
        """`bf16_gemm`: the model multiplies several bf16 rows on bf16 GEMMs (Compute.bf16_gemm): only then are
        bf16 experts packed."""
        s = layout.spec
        self.max_batch = s.num_experts
        self.layout = layout
        self.gate_up: dict[int, torch.Tensor] = {}
        self.down: dict[int, torch.Tensor] = {}
        self.raw: dict[int, torch.Tensor] = {}
        self.packed: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.bytes_read = 0
        self.requests = 0
        self.usage = torch.zeros((s.n_layers, s.num_experts), dtype=torch.int64)  # routing counts
        self._usage_rows = self.usage.numpy()  # the same memory: counted per expert, ~2 us (a torch index_put ~46)
        for layer in tqdm(layout.layers, desc="loading experts", unit="layer", disable=not progress, leave=False):
            raw = page_rows(s.num_experts, layout.slot_nbytes)  # huge pages: fewer TLB misses (pages.py)
            reqs = []
            for e in range(s.num_experts):
                reqs += expert_requests(layout, layer, e, raw[e])
            reader.read(reqs)
            self.bytes_read += sum(r.nbytes for r, _ in reqs)
            gu, dn = typed_views(layout, raw)
            if gu is None:
                self.raw[layer] = raw
            elif dtype is torch.bfloat16 and bf16_gemm and packable(*gu.shape[1:]) and packable(*dn.shape[1:]):
                # each expert's typed view of the read buffer, packed (a no-op .to for a bf16 checkpoint)
                self.packed[layer] = ([pack(w.to(dtype)) for w in gu], [pack(w.to(dtype)) for w in dn])
            else:  # contiguous copies in the compute dtype (the math indexes them per expert)
                self.gate_up[layer] = gu.to(dtype, copy=True).contiguous()
                self.down[layer] = dn.to(dtype, copy=True).contiguous()

    @property
    def nbytes(self) -> int:
        packed = sum(t.numel() * t.element_size() for gu, dn in self.packed.values() for t in gu + dn)
        return packed + sum(t.numel() * t.element_size() for d in (self.gate_up, self.down, self.raw)
                            for t in d.values())

    #: never a prediction to issue (prefetch_next is a no-op here)
    deferred = False

    def acquire(self, layer: int, experts: Sequence[int], hold: bool = False) -> ExpertBatch:
        self.requests += len(experts)
        row = self._usage_rows[layer]
        for e in experts:
            row[e] += 1
        return ExpertBatch(self.gate_up.get(layer), self.down.get(layer), list(experts), raw=self.raw.get(layer),
                           format=self.layout.format(layer), packed=self.packed.get(layer))

    def release(self, layer: int) -> None:
        pass

    def prefetch(self, layer: int, experts: Sequence[int], prompt: bool = False) -> None:
        pass

    def guessing(self) -> bool:
        return True  # no throttle: a prerouter here is a recorder (tools/prerouter_fit.py record), its prefetch a no-op

    def prefetch_next(self, layer: int, experts: Sequence[int]) -> None:
        pass

    def issue_deferred(self) -> None:
        pass

    def stats(self) -> dict:
        return {"hits": self.requests, "misses": 0, "load_bytes_read": self.bytes_read}

    def close(self) -> None:
        pass
