"""Mixtral (`model_type: mixtral`): GQA, every layer sparse, top-k weights always renormalised and kept in float32,
optional sliding window on all layers. Hub checkpoints name the block `block_sparse_moe` with experts w1/w3/w2
(gate/up/down); transformers>=5 fused checkpoints use `mlp.experts.gate_up_proj`."""

from __future__ import annotations

from dataclasses import dataclass

from .args import BaseArgs, sliding_windows
from .spec import Spec
from .schema import cfg, override

MOE_PREFIXES = ("block_sparse_moe", "mlp")
EXPERT_PROJ = ("w1", "w3", "w2")


@dataclass(kw_only=True)
class ModelArgs(BaseArgs):
    # num_experts: hub configs spell it num_local_experts (BaseArgs takes both)
    intermediate_size: int = cfg(ge=1)  # the experts' intermediate size
    rms_norm_eps: float = override(BaseArgs, "rms_norm_eps", 1e-5)
    max_position_embeddings: int = override(BaseArgs, "max_position_embeddings", 4096 * 32)
    sliding_window: int | None = cfg(None, ge=1)  # null: full attention

    DEFAULT_THETA = 1e6

    def spec(self) -> Spec:
        n = self.num_hidden_layers
        return self.base_spec(
            moe_intermediate_size=self.intermediate_size,
            sliding_window=sliding_windows(n, self.sliding_window),
            norm_topk_prob=True,
            router_weights_fp32=True,
        )
