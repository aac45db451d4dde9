"""OLMoE (`model_type: olmoe`): q/k RMSNorm over the whole projection (not per head), optional clip_qkv,
optional attention bias, softmax top-k router with optional renormalisation, every layer sparse, no sliding window."""

from __future__ import annotations

from dataclasses import dataclass

from .args import BaseArgs
from .blocks import Spec

MOE_PREFIXES = ("mlp",)
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")


@dataclass(kw_only=True)
class ModelArgs(BaseArgs):
    num_experts: int
    intermediate_size: int  # the experts' intermediate size
    model_type: str = "olmoe"
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    clip_qkv: float | None = None
    norm_topk_prob: bool = False

    ALIASES = {"num_local_experts": "num_experts"}

    def spec(self) -> Spec:
        n = self.num_hidden_layers
        return self.base_spec(
            num_experts=self.num_experts,
            moe_intermediate_size=self.intermediate_size,
            moe_layers=[True] * n,
            sliding_window=[None] * n,
            norm_topk_prob=self.norm_topk_prob,
            qkv_bias=self.attention_bias,
            o_bias=self.attention_bias,
            qk_norm="full",
            clip_qkv=self.clip_qkv,
        )
