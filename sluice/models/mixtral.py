"""Mixtral (`model_type: mixtral`): GQA, every layer sparse, top-k weights always renormalised and kept in float32,
optional sliding window on all layers. Hub checkpoints name the block `block_sparse_moe` with experts w1/w3/w2
(gate/up/down); transformers>=5 fused checkpoints use `mlp.experts.gate_up_proj`."""

from __future__ import annotations

from dataclasses import dataclass

from .args import BaseArgs, sliding_windows
from .blocks import Spec

MOE_PREFIXES = ("block_sparse_moe", "mlp")
EXPERT_PROJ = ("w1", "w3", "w2")


@dataclass(kw_only=True)
class ModelArgs(BaseArgs):
    num_local_experts: int
    intermediate_size: int  # the experts' intermediate size
    model_type: str = "mixtral"
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096 * 32
    sliding_window: int | None = None

    DEFAULT_THETA = 1e6

    ALIASES = {"num_experts": "num_local_experts"}

    def spec(self) -> Spec:
        n = self.num_hidden_layers
        return self.base_spec(
            num_experts=self.num_local_experts,
            moe_intermediate_size=self.intermediate_size,
            moe_layers=[True] * n,
            sliding_window=sliding_windows(n, self.sliding_window),
            norm_topk_prob=True,
            router_weights_fp32=True,
        )
