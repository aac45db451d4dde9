"""Prerouters: guess the next MoE layer's experts early so their reads overlap this layer's compute.

Predictions only drive prefetch; the true router always decides, so output never depends on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .models.blocks import Spec, Weights, rms_norm


class RouterPrerouter:
    """Training-free: apply layer L+1's router (and its post-attention norm) to the residual stream after layer
    L's attention, and take the top `k + margin` experts of the token(s)."""

    def __init__(self, spec: Spec, weights: Weights, margin: int = 0):
        self.spec, self.w, self.margin = spec, weights, margin
        moe = [i for i, s in enumerate(spec.moe_layers) if s]
        # layer -> the first MoE layer after it (dense layers in between are skipped)
        self.next_moe = {L: next((m for m in moe if m > L), None) for L in range(spec.n_layers)}

    def predict(self, layer: int, x: torch.Tensor) -> tuple[int, list[int]] | None:
        """(next MoE layer, predicted expert ids) from x [T, H] after `layer`'s attention, or None at the end."""
        nxt = self.next_moe.get(layer)
        if nxt is None:
            return None
        lw = self.w.layers[nxt]
        scores = F.linear(rms_norm(x, lw.post_norm, self.spec.rms_norm_eps), lw.router)  # [T, E]
        k = min(self.spec.num_experts, self.spec.top_k + self.margin)
        ids = torch.topk(scores, k, dim=-1).indices.flatten().unique()
        return nxt, ids.tolist()
