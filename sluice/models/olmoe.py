"""OLMoE (`model_type: olmoe`): q/k RMSNorm over the whole projection (not per head), optional clip_qkv,
optional attention bias, softmax top-k router with optional renormalisation, every layer sparse, no sliding window."""

from __future__ import annotations

from dataclasses import dataclass

from typing import Any

from ..errors import ConfigError
from .arch import GGUF_COMMON, GGUF_QK_NORM, GGUFArch, SynthDefaults
from .arch import layer_tensors as layer_tensors  # the shared layout, q/k norm over the whole projection
from .args import BaseArgs
from .spec import Spec
from .schema import cfg, override
from .layers import Attention, Build, PreNorm, moe_or_dense

MODEL_TYPE = "olmoe"
MOE_PREFIXES = ("mlp",)
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")
ROUTER = "gate"  # the router is `{prefix}.gate.weight` (store/layout.py moe_prefix)
MLX_MOE = "mlp"  # mlx-lm's name of the MoE block (tools/mlx_export.py)
MLX_VALUES: dict[str, str] = {}  # mlx-lm's converter keeps the values
synth_experts = synth_expert_nbytes = None  # make-model writes the per-expert / fused layouts
expert_layer = None  # store/layout.py reads the per-expert, fused or stacked expert layouts
synth_wrap = None  # make-model writes the text model alone
INTERMEDIATE_KEY = "intermediate_size"


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


# -- synthetic checkpoints (tools/synth.py) --------------------------------------------------------------------------
# OLMoE-1B-7B: 64 experts top-8, intermediate 1024 / hidden 2048.
SYNTH = SynthDefaults("OlmoeForCausalLM", num_experts=64, top_k=8, rope_theta=1e4, rms_norm_eps=1e-5)


def synth_config(sc) -> dict[str, Any]:
    """config.json keys of a synthetic olmoe (no clipping, no biases, plain top-k weights)."""
    if sc.num_heads * sc.head_dim != sc.hidden_size:
        # OLMoE's q_norm is sized hidden_size while q_proj is heads*head_dim: they must agree.
        raise ConfigError(f"olmoe needs num_heads * head_dim == hidden_size ({sc.hidden_size})")
    return dict(num_experts=sc.num_experts, intermediate_size=sc.moe_intermediate_size, norm_topk_prob=False,
                clip_qkv=None, attention_bias=False)


# -- GGUF (checkpoint/gguf_config.py) --------------------------------------------------------------------------------
def _gguf_config(m, tensors) -> dict[str, Any]:
    # llama.cpp's olmoe graph neither clamps q/k/v nor adds biases
    return dict(num_experts=m.int("expert_count"), intermediate_size=m.int("feed_forward_length"),
                attention_bias=False)


GGUF = GGUFArch("olmoe", tensors={**GGUF_COMMON, **GGUF_QK_NORM}, config=_gguf_config, norm_topk_prob=False)


def layers(b: Build) -> list[PreNorm]:
    """Pre-norm layers of grouped-query attention (q / k RMSNorm over the whole projection, clip_qkv) and a
    softmax-routed MoE block."""
    return [PreNorm(b, L, Attention(b, L), moe_or_dense(b, L)) for L in range(b.spec.n_layers)]
