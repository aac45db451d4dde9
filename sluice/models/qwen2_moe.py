"""Qwen2-MoE (`model_type: qwen2_moe`): q/k/v biases (qkv_bias), no q/k norm, a shared expert beside the routed
ones scaled by sigmoid(shared_expert_gate(x)), dense layers by mlp_only_layers / decoder_sparse_step, sliding window
on the layers `layer_types` (or max_window_layers) marks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from .args import BaseArgs, moe_layer_flags, sliding_windows
from .spec import Spec
from .qwen3_moe import dense_and_window_problems
from .schema import cfg, override

MOE_PREFIXES = ("mlp",)
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(kw_only=True)
class ModelArgs(BaseArgs):
    moe_intermediate_size: int = cfg(ge=1)
    # required: without it transformers builds a 5632-wide shared expert, a default sluice must not guess
    shared_expert_intermediate_size: int = cfg(ge=0)  # 0: no shared expert
    intermediate_size: int = cfg(0, ge=0)  # dense layers only (required then)
    max_position_embeddings: int = override(BaseArgs, "max_position_embeddings", 32768)
    qkv_bias: bool = cfg(True)
    norm_topk_prob: bool = cfg(False)
    decoder_sparse_step: int = cfg(1, ge=1)
    mlp_only_layers: list[int] | None = cfg(None, ge=0, lt="num_hidden_layers")
    use_sliding_window: bool = cfg(False)
    sliding_window: int | None = cfg(4096, ge=0)  # transformers>=5 writes 0 when use_sliding_window is false
    max_window_layers: int = cfg(28, ge=0)
    layer_types: list[str] | None = cfg(None, choices=LAYER_TYPES, length="num_hidden_layers")

    def moe_layers(self) -> list[bool]:
        return moe_layer_flags(self.num_hidden_layers, self.num_experts, self.decoder_sparse_step,
                               self.mlp_only_layers or [])

    def config_problems(self) -> Iterator[tuple[str, str]]:
        yield from super().config_problems()
        yield from dense_and_window_problems(self)

    def spec(self) -> Spec:
        n = self.num_hidden_layers
        layer_types = self.layer_types or [
            "sliding_attention" if (i + 1) % 2 and i < self.max_window_layers and self.use_sliding_window
            else "full_attention"
            for i in range(n)
        ]
        return self.base_spec(
            moe_intermediate_size=self.moe_intermediate_size,
            sliding_window=sliding_windows(n, self.sliding_window if self.use_sliding_window else None, layer_types),
            dense_intermediate_size=self.intermediate_size,
            shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            norm_topk_prob=self.norm_topk_prob,
            qkv_bias=self.qkv_bias,
            o_bias=False,
        )
