"""Qwen3-MoE (`model_type: qwen3_moe`): GQA with per-head q/k RMSNorm, softmax top-k router with optional
renormalised weights, optional dense layers (mlp_only_layers / decoder_sparse_step), optional sliding window."""

from __future__ import annotations

from dataclasses import dataclass, field

from .args import BaseArgs, moe_layer_flags, sliding_windows
from .blocks import Spec

# Checkpoint naming: the MoE block lives under `mlp`; per-expert projections are gate/up/down.
MOE_PREFIXES = ("mlp",)
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")


@dataclass(kw_only=True)
class ModelArgs(BaseArgs):
    num_experts: int
    moe_intermediate_size: int
    model_type: str = "qwen3_moe"
    intermediate_size: int = 0  # dense layers only
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    use_sliding_window: bool = False
    sliding_window: int | None = 4096

    ALIASES = {"num_local_experts": "num_experts"}

    def spec(self) -> Spec:
        n = self.num_hidden_layers
        return self.base_spec(
            num_experts=self.num_experts,
            moe_intermediate_size=self.moe_intermediate_size,
            moe_layers=moe_layer_flags(n, self.num_experts, self.decoder_sparse_step, self.mlp_only_layers or []),
            sliding_window=sliding_windows(n, self.sliding_window if self.use_sliding_window else None),
            dense_intermediate_size=self.intermediate_size,
            norm_topk_prob=self.norm_topk_prob,
            qkv_bias=self.attention_bias,
            o_bias=self.attention_bias,
            qk_norm="head",
        )
