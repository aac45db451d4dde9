"""GLM-4.5 / 4.6 / 4.5-Air (`model_type: glm4_moe`): GQA with optional q/k/v biases (attention_bias; o_proj has
none) and optional per-head q/k RMSNorm (use_qk_norm), partial rotary (the first head_dim * partial_rotary_factor
dims of each head rotate, rotate-half style; 0.5 when config.json says nothing, as transformers defaults it), the
first `first_k_dense_replace` layers dense (MLP of intermediate_size), the others MoE: the grouped sigmoid router
(models/routing.py "sigmoid_grouped": e_score_correction_bias for selection only, n_group / topk_group,
routed_scaling_factor) and n_shared_experts shared experts run as one ungated MLP of moe_intermediate_size *
n_shared_experts, added to every token. In bf16 the router's float32 weights multiply each expert's output before
the cast back, as transformers' eager Glm4MoeExperts does (the sigmoid router always returns float32 weights, so
Spec.router_weights_fp32, a softmax-router switch, is not needed): bitwise that module on one decode token
(tests/models/test_glm4_moe.py).

Checkpoint names under `model.layers.N.mlp`: the router `gate.weight` [E, H] and `gate.e_score_correction_bias`
[E], `shared_experts.{gate,up,down}_proj.weight`, experts per expert on the hub (`experts.{e}.gate_proj.weight`) or
fused by transformers>=5 (`experts.gate_up_proj`). Hub checkpoints also hold `num_nextn_predict_layers` multi-token
prediction layers after the last decoder layer (model.layers.46 of GLM-4.5-Air): speculative-decoding heads that
neither transformers' Glm4MoeForCausalLM nor sluice runs; their tensors are never read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from . import arch
from .arch import SynthDefaults, TensorName
from .args import CONFIG, BaseArgs, dense_and_grouped_router_problems
from .schema import cfg, override
from .spec import Spec
from .layers import Attention, Build, PreNorm, moe_or_dense

MODEL_TYPE = "glm4_moe"
MOE_PREFIXES = ("mlp",)
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")
ROUTER = "gate"  # the router is `{prefix}.gate.weight` (store/layout.py moe_prefix)
MLX_MOE = "mlp"  # mlx-lm's name of the MoE block (tools/mlx_export.py)
MLX_VALUES: dict[str, str] = {}  # mlx-lm's converter keeps the values
synth_experts = synth_expert_nbytes = None  # make-model writes the per-expert / fused layouts
expert_layer = None  # store/layout.py reads the per-expert, fused or stacked expert layouts
synth_wrap = None  # make-model writes the text model alone
INTERMEDIATE_KEY = "moe_intermediate_size"
#: transformers' Glm4MoeConfig sets partial_rotary_factor to this when config.json gives none
DEFAULT_PARTIAL_ROTARY = 0.5


@dataclass(kw_only=True)
class ModelArgs(BaseArgs):
    # hub configs spell the routed expert count n_routed_experts (transformers' attribute_map: num_local_experts)
    num_experts: int = cfg(ge=1, aliases=("n_routed_experts", "num_local_experts"))
    moe_intermediate_size: int = cfg(ge=1)
    intermediate_size: int = cfg(0, ge=0)  # the dense layers' MLP (required when first_k_dense_replace > 0)
    first_k_dense_replace: int = cfg(1, ge=0, lt="num_hidden_layers")  # < layers: at least one MoE layer
    n_shared_experts: int = cfg(1, ge=0)  # 0: none
    n_group: int = cfg(1, ge=1)  # divides the expert count (config_problems: named as the file spells it)
    topk_group: int = cfg(1, ge=1, le="n_group")
    routed_scaling_factor: float = cfg(1.0, gt=0, le=1e4)  # real models: 1 to ~16; 1e60 gave inf, then NaN logits
    norm_topk_prob: bool = cfg(True)
    use_qk_norm: bool = cfg(False)
    attention_bias: bool = cfg(False)
    rms_norm_eps: float = override(BaseArgs, "rms_norm_eps", 1e-5)
    max_position_embeddings: int = override(BaseArgs, "max_position_embeddings", 131072)

    @classmethod
    def from_dict(cls, config: dict, source: str | os.PathLike[str] = CONFIG):
        """BaseArgs.from_dict, with transformers' partial_rotary_factor default of 0.5 when the file has none (a
        partial_rotary_factor in rope_parameters still wins, as in transformers)."""
        if isinstance(config, dict) and config.get("partial_rotary_factor") is None:
            config = {**config, "partial_rotary_factor": DEFAULT_PARTIAL_ROTARY}
        return super().from_dict(config, source)

    def moe_layers(self) -> list[bool]:
        return [i >= self.first_k_dense_replace for i in range(self.num_hidden_layers)]

    def config_problems(self) -> Iterator[tuple[str, str]]:
        # without head_dim, transformers' Glm4MoeAttention takes hidden_size // num_attention_heads (floored, as
        # BaseArgs derives it), so a hidden size that is no multiple of the heads is not an error here
        yield from ((f, m) for f, m in super().config_problems() if f != "hidden_size")
        yield from dense_and_grouped_router_problems(self)

    def spec(self) -> Spec:
        return self.base_spec(
            moe_intermediate_size=self.moe_intermediate_size,
            sliding_window=[None] * self.num_hidden_layers,
            dense_intermediate_size=self.intermediate_size,
            shared_expert_intermediate_size=self.moe_intermediate_size * self.n_shared_experts,
            router="sigmoid_grouped",
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            norm_topk_prob=self.norm_topk_prob,
            qkv_bias=self.attention_bias,
            o_bias=False,
            qk_norm="head" if self.use_qk_norm else "none",
        )


def layer_tensors(spec: Spec, layer: int, moe: str | None) -> list[TensorName]:
    """One decoder layer's resident tensors: the shared layout of models/arch.py with the MoE block renamed to
    GLM's (and DeepSeek-V3's): the router's `gate.e_score_correction_bias` [E] beside `gate.weight`, the shared
    experts as `shared_experts.*` without a gate."""
    out = []
    for t in arch.layer_tensors(spec, layer, moe):
        if t.role == "shared_gate":
            continue
        if t.role.startswith("shared."):
            t = t._replace(name=t.name.replace(f"{moe}.shared_expert.", f"{moe}.shared_experts.", 1))
        out.append(t)
        if t.role == "router":
            out.append(TensorName("router_bias", f"{moe}.gate.e_score_correction_bias", (spec.num_experts,), "bias"))
    return out


#: GLM-4.5's added special tokens (its tokenizer_config.json), which llama.cpp's glm4moe converter reads by name
GLM_SPECIAL_TOKENS = ("[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>",
                      "<|observation|>")


# -- synthetic checkpoints (tools/synth.py) --------------------------------------------------------------------------
# GLM-4.5-Air: 128 routed experts top-8 (moe_intermediate 1408 / hidden 4096) plus 1 shared, n_group 1, the first
# layer dense (intermediate 10944, 7.8x an expert's), attention biases, no q/k norm, half the head dims rotary.
SYNTH = SynthDefaults("Glm4MoeForCausalLM", num_experts=128, top_k=8, rope_theta=1e6, rms_norm_eps=1e-5,
                      shared_expert=True, special_tokens=GLM_SPECIAL_TOKENS)


def synth_config(sc) -> dict[str, Any]:
    """config.json keys of a synthetic glm4_moe shaped like GLM-4.5-Air: the first layer dense (none when there is
    only one), `sc.shared_size / moe_intermediate_size` shared experts, one expert group, attention biases."""
    I, shared = sc.moe_intermediate_size, sc.shared_size
    if shared % I:
        raise ConfigError(f"glm4_moe's shared experts are n_shared_experts x moe_intermediate_size ({I}) wide: "
                          f"shared_expert_intermediate_size {shared} is not a multiple of it")
    return dict(n_routed_experts=sc.num_experts, moe_intermediate_size=I, n_shared_experts=shared // I,
                intermediate_size=8 * I, first_k_dense_replace=1 if sc.num_layers > 1 else 0, n_group=1,
                topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True, use_qk_norm=False, attention_bias=True,
                partial_rotary_factor=DEFAULT_PARTIAL_ROTARY, num_nextn_predict_layers=0,
                rope_scaling=None)  # as the hub's config.json has it (mlx-lm's glm4_moe requires the key)


# -- GGUF (checkpoint/gguf_config.py) --------------------------------------------------------------------------------
def _gguf_config(m, tensors) -> dict[str, Any]:
    """llama.cpp's glm4moe keys: the sigmoid router's (arch.sigmoid_router_gguf_config; its loader defaults the
    gating to sigmoid), q/k norm and q/k/v biases where the file has them (its graph applies them where present); the
    rotary part from rope.dimension_count (the generic reader). GLM-4.5V's multimodal rope is refused."""
    key = m.key("rope.dimension_sections")
    if any(m.gf.metadata.get(key) or ()):
        raise ConfigError(f"{m.file}: metadata {key} sets a multimodal rope (GLM-4.5V); sluice runs the text rope only")
    return {**arch.sigmoid_router_gguf_config(m, gating_default=2),
            "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors, "attention_bias": "blk.0.attn_q.bias" in tensors}


# llama.cpp's names: the shared ones, its post-attention norm, a dense first layer, the grouped sigmoid router and
# shared experts. The blocks after the model's (nextn_predict_layers: GLM's multi-token-prediction layer) are listed
# by the reader under their GGUF names and never read.
GGUF = arch.GGUFArch("glm4moe", tensors={
    **arch.GGUF_ATTN, **arch.GGUF_QKV_BIAS, **arch.GGUF_QK_NORM, **arch.GGUF_DENSE, **arch.GGUF_SIGMOID_MOE,
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
}, config=_gguf_config, norm_topk_prob=False, own_keys=arch.SIGMOID_ROUTER_KEYS, partial_rope=True)


def layers(b: Build) -> list[PreNorm]:
    """Pre-norm layers of grouped-query attention (partial rotary, optional q / k norm) and a sigmoid
    grouped-routed MoE block with a shared expert, dense on the first first_k_dense_replace layers."""
    return [PreNorm(b, L, Attention(b, L), moe_or_dense(b, L)) for L in range(b.spec.n_layers)]
