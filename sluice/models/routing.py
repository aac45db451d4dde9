"""Routers: hidden states -> (each token's top-k expert ids, their weights). One function per routing family,
chosen by `Spec.router`; the MoE block (models/layers/moe.py) only calls `route`.

- "softmax" (Qwen2/3-MoE, Mixtral, OLMoE): softmax over all experts in float32, top-k, optional renormalisation
  (norm_topk_prob); the weights are cast to the compute dtype unless the reference keeps them in float32
  (router_weights_fp32, Mixtral).
- "sigmoid_grouped" (GLM-4.5 glm4_moe, DeepSeek-V3 / Kimi K2 deepseek_v3): sigmoid scores in float32; the selection
  adds a per-expert bias (e_score_correction_bias, selection only) and keeps only the `topk_group` best of `n_group`
  expert groups (a group's score: the sum of its two best biased scores); the weights are the unbiased scores,
  optionally renormalised, times routed_scaling_factor, kept in float32 as the reference multiplies them.
- "topk_softmax" (gpt-oss): logits with the router's bias, top-k of the logits, softmax over those k only, in the
  compute dtype (as the reference does it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant.matmul import rows_linear
from .spec import LayerWeights, Spec


def softmax_topk(spec: Spec, lw: LayerWeights, x: torch.Tensor, bf16: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (weights [T, K], ids [T, K]): softmax over every expert, then top-k. `bf16`: the model's
    Compute.bf16_gemm; without it a prompt's router logits take rows_linear's float32 GEMM (AVX2: torch's bf16 GEMM
    took 8.2 ms a layer of [2048 x 1024] @ [1024 x 64] on the peers model, 130 ms of a 2,048-token prompt, now 39;
    torch's profiler, Intel Xeon capped at AVX2: benchmarks/results/quantized/breakdown/prompt-profile.txt)."""
    scores = rows_linear(x, lw.router, None, bf16)  # [T, E]
    return top_of_probs(spec, torch.softmax(scores, dim=-1, dtype=torch.float32), x.dtype)


def top_of_probs(spec: Spec, probs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The rest of softmax_topk from float32 probabilities [T, E] (a native decode step computes them in one call,
    models/layers/moe.py): top-k, the optional renormalisation, the weights in `dtype` unless router_weights_fp32."""
    weights, ids = torch.topk(probs, spec.top_k, dim=-1)  # [T, K] each
    if spec.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not spec.router_weights_fp32:
        weights = weights.to(dtype)
    return weights, ids


def _biased_logits(lw: LayerWeights, x: torch.Tensor, bf16: bool = True) -> torch.Tensor:
    """x [T, H] -> router logits [T, E] plus the router's bias when it has one (gpt-oss; stored bf16 there, so the
    cast from the float32 the loader keeps is exact); several rows in float32 unless `bf16` (softmax_topk)."""
    bias = None if lw.router_bias is None else lw.router_bias.to(x.dtype)
    return rows_linear(x, lw.router, bias, bf16)


def _sigmoid_scores(lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> float32 sigmoid scores [T, E] of the router, computed in float32 as the reference does."""
    return torch.sigmoid(F.linear(x.float(), lw.router.float()))


def _grouped_choice(spec: Spec, lw: LayerWeights, scores: torch.Tensor) -> torch.Tensor:
    """Sigmoid scores [T, E] -> the selection scores: plus the correction bias, -inf outside each token's
    `topk_group` best groups (a group's score: the sum of its two best)."""
    T, E, G = scores.shape[0], spec.num_experts, spec.n_group
    choice = scores if lw.router_bias is None else scores + lw.router_bias  # [T, E]
    if G > 1 and spec.topk_group < G:
        group_scores = choice.view(T, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        keep = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)  # [T, G]
        choice = choice.masked_fill(~mask.repeat_interleave(E // G, dim=1), float("-inf"))
    return choice


def sigmoid_grouped_topk(spec: Spec, lw: LayerWeights, x: torch.Tensor,
                         bf16: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (float32 weights [T, K], ids [T, K]): grouped top-k over biased sigmoid scores (see the module
    docstring). Selection ties resolve as torch.topk does in the reference. (Scores in float32 whatever `bf16`.)"""
    scores = _sigmoid_scores(lw, x)  # [T, E] float32
    ids = torch.topk(_grouped_choice(spec, lw, scores), k=spec.top_k, dim=-1, sorted=False)[1]  # [T, K]
    weights = scores.gather(1, ids)  # [T, K]
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * spec.routed_scaling_factor, ids


def topk_softmax(spec: Spec, lw: LayerWeights, x: torch.Tensor, bf16: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (weights [T, K], ids [T, K]): top-k of the biased logits, then softmax over those k."""
    logits = _biased_logits(lw, x, bf16)  # [T, E]
    top, ids = torch.topk(logits, spec.top_k, dim=-1)  # [T, K] each
    return torch.softmax(top, dim=-1, dtype=top.dtype), ids


ROUTERS = {"softmax": softmax_topk, "sigmoid_grouped": sigmoid_grouped_topk, "topk_softmax": topk_softmax}


def selection_scores(spec: Spec, lw: LayerWeights, x: torch.Tensor, bf16: bool = True) -> torch.Tensor:
    """x [T, H] -> [T, E] scores whose top-k are the experts `route` picks (its ranking, not its weights): what a
    prerouter ranks to guess more than k of them. The grouped router's excluded groups score -inf. `bf16`: as for
    `route` (the model's Compute.bf16_gemm): a prompt's rows on a float32 GEMM without it."""
    if spec.router == "sigmoid_grouped":
        return _grouped_choice(spec, lw, _sigmoid_scores(lw, x))
    return _biased_logits(lw, x, bf16)  # softmax is monotonic: the logits rank as the probabilities do


def route(spec: Spec, lw: LayerWeights, x: torch.Tensor, bf16: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The true router of layer weights `lw` on x [T, H] -> (weights [T, K], ids [T, K]); `bf16`: whether several
    bf16 rows take torch's bf16 GEMM (the model's Compute.bf16_gemm) or a float32 one (quant/matmul.rows_linear)."""
    return ROUTERS[spec.router](spec, lw, x, bf16)
