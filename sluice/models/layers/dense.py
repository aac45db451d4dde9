"""A dense gated MLP: down(act(gate x) * up x) on resident weights (dense layers; a shared expert beside the routed
ones, layers/moe.py)."""

from __future__ import annotations

import torch

from ..linear import linear
from ..spec import MLPWeights
from .build import Build, Step


class DenseMLP:
    """The MLP of weights `m` (MLPWeights: gate / up [I, H], down [H, I]): x [T, H] -> [T, H]."""

    def __init__(self, b: Build, m: MLPWeights):
        self.m, self.act, self.bf16 = m, b.act, b.compute.bf16_gemm

    def __call__(self, x: torch.Tensor, step: Step | None = None) -> torch.Tensor:
        m, bf16 = self.m, self.bf16
        return linear(self.act(linear(x, m.gate, None, bf16)) * linear(x, m.up, None, bf16), m.down, None, bf16)


def dense_mlp(b: Build, L: int) -> DenseMLP:
    """Layer L's dense MLP (a layer moe_layers marks False)."""
    return DenseMLP(b, b.w.layers[L].mlp)
