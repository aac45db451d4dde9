"""The routed experts' math from slot bytes: SwiGLU y = down(act(gate x) * up x) for one expert.

Plain experts (BF16/F16/F32) run F.linear on typed views of the slots, gate and up as one [2I, H] matrix; quantized
experts run each projection from its stored bytes (quant/stored.py), with one float32 scratch reused by every call.
The same function serves the resident and the streaming store, so a streamed run computes bitwise what a resident
run computes on the same slots.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..quant.stored import StoredLinear


class ExpertMath:
    """Expert forward passes for every storage format the layout holds, at one compute dtype."""

    def __init__(self, dtype: torch.dtype, act: Callable[[torch.Tensor], torch.Tensor]):
        self.dtype, self.act = dtype, act
        self._kernels: dict[object, tuple] = {}
        self._scratch = torch.empty(0, dtype=torch.float32)

    def __call__(self, batch, j: int, x: torch.Tensor) -> torch.Tensor:
        """The j-th expert of `batch` (store/base.py ExpertBatch) on x [n, H] -> [n, H]."""
        slot = batch.slots[j]
        if batch.gate_up is not None:
            gu = batch.gate_up[slot]  # [2I, H]
            dn = batch.down[slot]  # [H, I]
            if gu.dtype != x.dtype:  # streamed slots keep the checkpoint dtype
                gu, dn = gu.to(x.dtype), dn.to(x.dtype)
            g, u = F.linear(x, gu).chunk(2, dim=-1)  # [n, I] each
            return F.linear(self.act(g) * u, dn)
        fmt, raw = batch.format, batch.raw[slot]
        gate_up, gate, up, down = self._kernels_for(fmt)
        if gate_up is not None:  # one call over the 2I rows of [gate; up]
            g, u = gate_up(x, raw[: fmt.up_offset + fmt.up.nbytes], self._scratch).chunk(2, dim=-1)  # [n, I] each
        else:
            g = gate(x, raw[: fmt.gate.nbytes], self._scratch)  # [n, I]
            u = up(x, raw[fmt.up_offset : fmt.up_offset + fmt.up.nbytes], self._scratch)  # [n, I]
        return down(self.act(g) * u, raw[fmt.down_offset : fmt.down_offset + fmt.down.nbytes], self._scratch)

    def _kernels_for(self, fmt) -> tuple:
        """(gate_up or None, gate, up, down) StoredLinears of one ExpertFormat, built once."""
        k = self._kernels.get(fmt)
        if k is None:
            specs = (fmt.gate_up, fmt.gate, fmt.up, fmt.down)
            k = self._kernels[fmt] = tuple(None if s is None else StoredLinear(s, self.dtype) for s in specs)
            need = max(x.scratch_numel for x in k if x is not None)
            if self._scratch.numel() < need:  # sized once per format, at the first expert of a new format
                self._scratch = torch.empty(need, dtype=torch.float32)
        return k
