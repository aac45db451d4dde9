"""Qwen2-MoE (`model_type: qwen2_moe`): q/k/v biases (qkv_bias), no q/k norm, a shared expert beside the routed
ones scaled by sigmoid(shared_expert_gate(x)), dense layers by mlp_only_layers / decoder_sparse_step, sliding window
on the layers `layer_types` (or max_window_layers) marks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from typing import Any

from .arch import GGUF_COMMON, GGUF_QKV_BIAS, GGUF_SHARED, GGUFArch, SynthDefaults
from .arch import layer_tensors as layer_tensors  # the shared layout; the shared expert is spec-driven
from .args import BaseArgs, moe_layer_flags, sliding_windows
from .spec import Spec
from .qwen3_moe import dense_and_window_problems, qwen_gguf_config
from .schema import cfg, override
from .layers import Attention, Build, PreNorm, moe_or_dense

MODEL_TYPE = "qwen2_moe"
MOE_PREFIXES = ("mlp",)
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")
ROUTER = "gate"  # the router is `{prefix}.gate.weight` (store/layout.py moe_prefix)
MLX_MOE = "mlp"  # mlx-lm's name of the MoE block (tools/mlx_export.py)
MLX_VALUES: dict[str, str] = {}  # mlx-lm's converter keeps the values
synth_experts = synth_expert_nbytes = None  # make-model writes the per-expert / fused layouts
expert_layer = None  # store/layout.py reads the per-expert, fused or stacked expert layouts
synth_wrap = None  # make-model writes the text model alone
INTERMEDIATE_KEY = "moe_intermediate_size"
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


# -- synthetic checkpoints (tools/synth.py) --------------------------------------------------------------------------
# Qwen1.5-MoE-A2.7B: 60 experts top-4 plus a shared expert; 64 top-8 here like the others.
SYNTH = SynthDefaults("Qwen2MoeForCausalLM", num_experts=64, top_k=8, rope_theta=1e6, rms_norm_eps=1e-6,
                      shared_expert=True)


def synth_config(sc) -> dict[str, Any]:
    """config.json keys of a synthetic qwen2_moe: a shared expert of `sc.shared_size`, q/k/v biases, every layer
    sparse, no sliding window."""
    Is = sc.shared_size
    return dict(num_experts=sc.num_experts, moe_intermediate_size=sc.moe_intermediate_size,
                shared_expert_intermediate_size=Is, intermediate_size=Is, decoder_sparse_step=1, mlp_only_layers=[],
                norm_topk_prob=False, qkv_bias=True, use_sliding_window=False, sliding_window=None)


# -- GGUF (checkpoint/gguf_config.py) --------------------------------------------------------------------------------
def _gguf_config(m, tensors) -> dict[str, Any]:
    ff = m.int("feed_forward_length", 0, minimum=0)
    return {**qwen_gguf_config(m, tensors),
            "shared_expert_intermediate_size": m.int("expert_shared_feed_forward_length", ff or m.REQUIRED),
            "qkv_bias": "blk.0.attn_q.bias" in tensors}


GGUF = GGUFArch("qwen2moe", tensors={**GGUF_COMMON, **GGUF_QKV_BIAS, **GGUF_SHARED}, config=_gguf_config,
                norm_topk_prob=False)


def layers(b: Build) -> list[PreNorm]:
    """Pre-norm layers of grouped-query attention (q / k / v biases) and a softmax-routed MoE block with a
    sigmoid-gated shared expert, or a dense MLP."""
    return [PreNorm(b, L, Attention(b, L), moe_or_dense(b, L)) for L in range(b.spec.n_layers)]
