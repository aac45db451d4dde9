"""Routers: hidden states -> (each token's top-k expert ids, their weights). One function per routing family,
chosen by `Spec.router`; the MoE block (models/blocks.py) only calls `route`.

- "softmax" (Qwen2/3-MoE, Mixtral, OLMoE): softmax over all experts in float32, top-k, optional renormalisation
  (norm_topk_prob); the weights are cast to the compute dtype unless the reference keeps them in float32
  (router_weights_fp32, Mixtral).
- "topk_softmax" (gpt-oss): logits with the router's bias, top-k of the logits, softmax over those k only, in the
  compute dtype (as the reference does it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .spec import LayerWeights, Spec


def softmax_topk(spec: Spec, lw: LayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (weights [T, K], ids [T, K]): softmax over every expert, then top-k."""
    scores = F.linear(x, lw.router)  # [T, E]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, spec.top_k, dim=-1)  # [T, K] each
    if spec.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not spec.router_weights_fp32:
        weights = weights.to(x.dtype)
    return weights, ids


def topk_softmax(spec: Spec, lw: LayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (weights [T, K], ids [T, K]): top-k of the biased logits, then softmax over those k."""
    logits = F.linear(x, lw.router, lw.router_bias)  # [T, E]
    top, ids = torch.topk(logits, spec.top_k, dim=-1)  # [T, K] each
    return torch.softmax(top, dim=-1, dtype=top.dtype), ids


ROUTERS = {"softmax": softmax_topk, "topk_softmax": topk_softmax}


def route(spec: Spec, lw: LayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The true router of layer weights `lw` on x [T, H] -> (weights [T, K], ids [T, K])."""
    return ROUTERS[spec.router](spec, lw, x)
