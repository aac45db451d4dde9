"""OLMoE (`model_type: olmoe`): q/k RMSNorm over the whole projection (not per head), optional clip_qkv,
optional attention bias, softmax top-k router with optional renormalisation, every layer sparse, no sliding window."""

from __future__ import annotations

from dataclasses import dataclass

from .args import BaseArgs
from .spec import Spec
from .schema import cfg, override

MOE_PREFIXES = ("mlp",)
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")


@dataclass(kw_only=True)
class ModelArgs(BaseArgs):
    intermediate_size: int = cfg(ge=1)  # the experts' intermediate size
    rms_norm_eps: float = override(BaseArgs, "rms_norm_eps", 1e-5)
    attention_bias: bool = cfg(False)
    clip_qkv: float | None = cfg(None, gt=0)  # null: no clipping
    norm_topk_prob: bool = cfg(False)

    def spec(self) -> Spec:
        n = self.num_hidden_layers
        return self.base_spec(
            moe_intermediate_size=self.intermediate_size,
            sliding_window=[None] * n,
            norm_topk_prob=self.norm_topk_prob,
            qkv_bias=self.attention_bias,
            o_bias=self.attention_bias,
            qk_norm="full",
            clip_qkv=self.clip_qkv,
        )
