"""Qwen2-MoE (`model_type: qwen2_moe`): q/k/v biases (qkv_bias), no q/k norm, a shared expert beside the routed
ones scaled by sigmoid(shared_expert_gate(x)), dense layers by mlp_only_layers / decoder_sparse_step, sliding window
on the layers `layer_types` (or max_window_layers) marks."""

from __future__ import annotations

from dataclasses import dataclass, field

from .args import BaseArgs, moe_layer_flags, sliding_windows
from .blocks import Spec

MOE_PREFIXES = ("mlp",)
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")


@dataclass(kw_only=True)
class ModelArgs(BaseArgs):
    num_experts: int
    moe_intermediate_size: int
    model_type: str = "qwen2_moe"
    intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    max_position_embeddings: int = 32768
    qkv_bias: bool = True
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: list[str] | None = None

    ALIASES = {"num_local_experts": "num_experts"}

    def spec(self) -> Spec:
        n = self.num_hidden_layers
        layer_types = self.layer_types or [
            "sliding_attention" if (i + 1) % 2 and i < self.max_window_layers and self.use_sliding_window
            else "full_attention"
            for i in range(n)
        ]
        return self.base_spec(
            num_experts=self.num_experts,
            moe_intermediate_size=self.moe_intermediate_size,
            moe_layers=moe_layer_flags(n, self.num_experts, self.decoder_sparse_step, self.mlp_only_layers or []),
            sliding_window=sliding_windows(n, self.sliding_window if self.use_sliding_window else None, layer_types),
            dense_intermediate_size=self.intermediate_size,
            shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            norm_topk_prob=self.norm_topk_prob,
            qkv_bias=self.qkv_bias,
            o_bias=False,
        )
