"""DeepSeek-V3 / R1 and Kimi K2 (`model_type: deepseek_v3`): multi-head latent attention (models/layers/mla.py: a KV
cache of compressed latents), the grouped sigmoid router (models/routing.py "sigmoid_grouped":
e_score_correction_bias for selection, n_group / topk_group, routed_scaling_factor), n_shared_experts shared experts
run as one ungated MLP, the first `first_k_dense_replace` layers dense, yarn rope whose mscale_all_dim also scales
the softmax."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..checkpoint.gguf_config import rope_scaling
from .arch import (GGUF_DENSE, GGUF_SIGMOID_MOE, SIGMOID_ROUTER_KEYS, GGUFArch, SynthDefaults, TensorName, mlp_tensors,
                   sigmoid_router_gguf_config)
from .args import MAX_HEAD_DIM, BaseArgs, dense_and_grouped_router_problems
from .rope import RopeConfig
from .schema import cfg
from .spec import MLASpec, Spec
from .layers import Build, LatentAttention, PreNorm, moe_or_dense

MODEL_TYPE = "deepseek_v3"
MOE_PREFIXES = ("mlp",)
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")
ROUTER = "gate"  # the router is `{prefix}.gate.weight` (store/layout.py moe_prefix)
MLX_MOE = "mlp"  # mlx-lm's name of the MoE block (tools/mlx_export.py)
MLX_VALUES: dict[str, str] = {}  # mlx-lm's converter keeps the values
synth_experts = synth_expert_nbytes = None  # make-model writes the per-expert / fused layouts
expert_layer = None  # store/layout.py reads the per-expert, fused or stacked expert layouts
synth_wrap = None  # make-model writes the text model alone
INTERMEDIATE_KEY = "moe_intermediate_size"


@dataclass(kw_only=True)
class ModelArgs(BaseArgs):
    # defaults: transformers' DeepseekV3Config (DeepSeek-V3's own values), so a key left out means what it means there
    num_experts: int = cfg(ge=1, aliases=("n_routed_experts", "num_local_experts"))
    moe_intermediate_size: int = cfg(ge=1)
    intermediate_size: int = cfg(0, ge=0)  # the dense layers' MLP (required when first_k_dense_replace > 0)
    n_shared_experts: int = cfg(1, ge=0)  # run as one MLP of n_shared_experts * moe_intermediate_size
    first_k_dense_replace: int = cfg(3, ge=0, lt="num_hidden_layers")  # < layers: at least one MoE layer
    n_group: int = cfg(8, ge=1, divides="num_experts")
    topk_group: int = cfg(4, ge=1, le="n_group")
    routed_scaling_factor: float = cfg(2.5, gt=0, le=1e4)  # real models: 1 to ~16; 1e60 gave inf, then NaN logits
    norm_topk_prob: bool = cfg(True)
    q_lora_rank: int | None = cfg(1536, ge=1)  # null: a plain q_proj
    kv_lora_rank: int = cfg(512, ge=1)
    qk_nope_head_dim: int = cfg(128, ge=1, le=MAX_HEAD_DIM)
    qk_rope_head_dim: int = cfg(64, ge=2, le=MAX_HEAD_DIM)
    v_head_dim: int = cfg(128, ge=1, le=MAX_HEAD_DIM)
    rope_interleave: bool | None = cfg(True)  # null: halves, as transformers reads it
    attention_bias: bool = cfg(False)  # biases on q_a_proj, kv_a_proj_with_mqa and o_proj
    # kv_b_proj stored split per head, as llama.cpp's deepseek2 converter writes it (set by the GGUF reader): k_b_proj
    # [nH, r, N] (each head's key rows transposed) and v_b_proj [nH, V, r]; models/weights.py joins them back
    kv_b_split: bool = cfg(False)
    quantization_config: dict | None = cfg(None)  # the hub's FP8 uploads: read by checkpoint/fp8_index.py

    def __post_init__(self):
        super().__post_init__()
        # rope rotates qk_rope_head_dim dims (transformers sets head_dim to it, whatever config.json says)
        self.head_dim = self.qk_rope_head_dim

    def moe_layers(self) -> list[bool]:
        return [i >= self.first_k_dense_replace for i in range(self.num_hidden_layers)]

    def config_problems(self) -> Iterator[tuple[str, str]]:
        # hidden_size / num_attention_heads sizes nothing here: the head dims are their own keys
        yield from ((f, m) for f, m in super().config_problems() if f != "hidden_size")
        method = (self.quantization_config or {}).get("quant_method")
        if method is not None and str(method).lower() != "fp8":  # fp8: DeepSeek-V3/R1 and Kimi K2 as uploaded
            yield "quantization_config", (
                f"quant_method {method!r}: weights quantized this way would be read without their scales (a wrong "
                "answer), and sluice does not compute them: use the FP8 upload, a bf16 conversion of the model or a "
                "GGUF file")
        if self.qk_rope_head_dim % 2:
            yield "qk_rope_head_dim", f"{self.qk_rope_head_dim} is odd; rope rotates pairs: expected an even size"
        yield from dense_and_grouped_router_problems(self)

    def softmax_scale(self, rope: RopeConfig) -> float:
        """qk_head_dim^-0.5, times yarn's mscale(factor, mscale_all_dim)^2 when a scaled rope sets mscale_all_dim
        (DeepSeek's softmax correction; transformers' yarn_apply_mscale)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        mscale_all = rope.params.get("mscale_all_dim") if rope.rope_type != "default" else None
        if mscale_all:
            p = rope.params
            factor = p.get("factor") or rope.max_position_embeddings / p.get(
                "original_max_position_embeddings", rope.max_position_embeddings)
            m = 1.0 if factor <= 1 else 0.1 * mscale_all * math.log(factor) + 1.0
            scale = scale * m * m  # in transformers' order: bitwise its scaling
        return scale

    def spec(self) -> Spec:
        spec = self.base_spec(
            moe_intermediate_size=self.moe_intermediate_size,
            sliding_window=[None] * self.num_hidden_layers,
            dense_intermediate_size=self.intermediate_size,
            shared_expert_intermediate_size=self.n_shared_experts * self.moe_intermediate_size,
            norm_topk_prob=self.norm_topk_prob,
            router="sigmoid_grouped",
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            o_bias=self.attention_bias,
        )
        spec.mla = MLASpec(q_lora_rank=self.q_lora_rank or 0, kv_lora_rank=self.kv_lora_rank,
                           qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                           v_head_dim=self.v_head_dim, softmax_scale=self.softmax_scale(spec.rope),
                           rope_interleave=bool(self.rope_interleave), kv_b_split=self.kv_b_split)
        return spec


def layer_tensors(spec: Spec, layer: int, moe: str | None) -> list[TensorName]:
    """One decoder layer's resident tensors: latent attention (q_a/q_b or q_proj, kv_a_proj_with_mqa, the two lora
    norms, kv_b_proj, o_proj), then the router with its e_score_correction_bias and the shared experts, or the dense
    MLP of the first first_k_dense_replace layers. Roles: models/weights.py builds MLAWeights from the `mla.` ones."""
    s, m = spec, spec.mla
    H, nH, Q, r = s.hidden_size, s.n_heads, m.q_lora_rank, m.kv_lora_rank
    p = f"model.layers.{layer}"
    a = f"{p}.self_attn"
    bias = s.o_bias  # attention_bias: q_a, kv_a and o together
    out = [TensorName("input_norm", f"{p}.input_layernorm.weight", (H,), "norm")]
    if Q:
        out.append(TensorName("mla.q_a", f"{a}.q_a_proj.weight", (Q, H), "proj"))
        if bias:
            out.append(TensorName("mla.q_a_bias", f"{a}.q_a_proj.bias", (Q,), "bias"))
        out += [TensorName("mla.q_a_norm", f"{a}.q_a_layernorm.weight", (Q,), "norm"),
                TensorName("mla.q_b", f"{a}.q_b_proj.weight", (nH * m.qk_head_dim, Q), "proj")]
    else:
        out.append(TensorName("mla.q", f"{a}.q_proj.weight", (nH * m.qk_head_dim, H), "proj"))
    out.append(TensorName("mla.kv_a", f"{a}.kv_a_proj_with_mqa.weight", (m.cache_dim, H), "proj"))
    if bias:
        out.append(TensorName("mla.kv_a_bias", f"{a}.kv_a_proj_with_mqa.bias", (m.cache_dim,), "bias"))
    out += [TensorName("mla.kv_a_norm", f"{a}.kv_a_layernorm.weight", (r,), "norm"),
            *kv_b_tensors(m, nH, a), TensorName("o", f"{a}.o_proj.weight", (H, nH * m.v_head_dim), "proj")]
    if bias:
        out.append(TensorName("o_bias", f"{a}.o_proj.bias", (H,), "bias"))
    out.append(TensorName("post_norm", f"{p}.post_attention_layernorm.weight", (H,), "norm"))
    if s.moe_layers[layer]:
        out += [TensorName("router", f"{moe}.gate.weight", (s.num_experts, H), "proj"),
                TensorName("router_bias", f"{moe}.gate.e_score_correction_bias", (s.num_experts,), "bias")]
        if s.shared_expert_intermediate_size:
            out += mlp_tensors("shared.", f"{moe}.shared_experts", s.shared_expert_intermediate_size, H)
    else:
        out += mlp_tensors("mlp.", f"{p}.mlp", s.dense_intermediate_size, H)
    return out


def kv_b_tensors(m: MLASpec, n_heads: int, a: str) -> list[TensorName]:
    """kv_b_proj [nH*(N+V), r] under attention prefix `a`, or (MLASpec.kv_b_split) its two parts as llama.cpp's
    converter stores them: k_b [nH, r, N] and v_b [nH, V, r] (roles mla.k_b / mla.v_b)."""
    N, V, r = m.qk_nope_head_dim, m.v_head_dim, m.kv_lora_rank
    if m.kv_b_split:
        return [TensorName("mla.k_b", f"{a}.k_b_proj.weight", (n_heads, r, N), "proj"),
                TensorName("mla.v_b", f"{a}.v_b_proj.weight", (n_heads, V, r), "proj")]
    return [TensorName("mla.kv_b", f"{a}.kv_b_proj.weight", (n_heads * (N + V), r), "proj")]


# -- synthetic checkpoints (tools/synth.py) --------------------------------------------------------------------------
# DeepSeek-V3 / Kimi K2: 256 / 384 experts top-8 in 8 groups (4 selectable), one shared expert, rope theta 10000
SYNTH = SynthDefaults("DeepseekV3ForCausalLM", num_experts=256, top_k=8, rope_theta=10000.0, rms_norm_eps=1e-6,
                      shared_expert=True)


#: how the hub's config.json names the router (transformers' DeepseekV3 hard-codes it, saving neither key; llama.cpp's
#: converter reads scoring_func, and without it the file routes by softmax in llama.cpp)
HUB_ROUTER = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def synth_config(sc) -> dict[str, Any]:
    """config.json keys of a synthetic deepseek_v3, in DeepSeek-V3's proportions to SynthConfig.head_dim (128 there):
    qk_nope = v = head_dim, qk_rope = head_dim / 2, kv_lora_rank = 4 x, q_lora_rank = 12 x, both at most hidden / 2
    (DeepSeek-V3: 512 and 1536 of 7168; uncapped, a small model's attention would outweigh its experts); 8 expert groups (4
    selectable) when the experts split into groups of >= 2; the dense first layer of Kimi K2 (DeepSeek-V3 has 3)
    unless the model has <= 2 layers; routed_scaling_factor 2.5; interleaved rope; the hub's router keys."""
    E, K, I, hd, H = sc.num_experts, sc.top_k, sc.moe_intermediate_size, sc.head_dim, sc.hidden_size
    if hd % 4:
        raise ConfigError(f"head_dim: deepseek_v3 rotates head_dim / 2 dims in pairs: expected a multiple of 4, "
                          f"got {hd}")
    shared = sc.shared_size
    if shared % I:
        raise ConfigError(f"shared_expert_intermediate_size: deepseek_v3 runs n_shared_experts experts of "
                          f"moe_intermediate_size ({I}) as one MLP: expected a multiple of it, got {shared}")
    n_group = 8 if E % 8 == 0 and E // 8 >= 2 else 1
    topk_group = n_group // 2 if K <= (n_group // 2) * (E // n_group) else n_group
    return dict(n_routed_experts=E, moe_intermediate_size=I, intermediate_size=9 * I, n_shared_experts=shared // I,
                first_k_dense_replace=1 if sc.num_layers > 2 else 0, n_group=n_group, topk_group=max(1, topk_group),
                routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=min(12 * hd, H // 2),
                kv_lora_rank=min(4 * hd, H // 2),
                qk_nope_head_dim=hd, qk_rope_head_dim=hd // 2, v_head_dim=hd, head_dim=hd // 2,
                num_key_value_heads=sc.num_heads, rope_interleave=True, attention_bias=False,
                **HUB_ROUTER)


# -- GGUF (checkpoint/gguf_config.py) --------------------------------------------------------------------------------
def _gguf_config(m, tensors) -> dict[str, Any]:
    """llama.cpp's deepseek2 keys: the latent attention's sizes (key_length_mla = nope + rope dims, value_length_mla;
    files from before those keys: key_length / value_length), the sigmoid router (arch.sigmoid_router_gguf_config;
    a file without expert_gating_func routes by softmax in llama.cpp: DeepSeek-V2, refused), interleaved rope (its
    graph's NORM rope, whatever the checkpoint's rope_interleave was), biases where the file has them, kv_b as the
    file stores it (split into attn_k_b / attn_v_b by current converters), and the YaRN scales llama.cpp computes."""
    heads, R = m.int("attention.head_count"), m.int("rope.dimension_count")
    k_mla = m.int("attention.key_length_mla", m.int("attention.key_length"))
    if k_mla <= R:
        raise ConfigError(f"{m.file}: metadata {m.key('attention.key_length_mla')} {k_mla} leaves no dims beside the "
                          f"{R} rotary ones ({m.key('rope.dimension_count')})")
    return {**sigmoid_router_gguf_config(m, gating_default=1), "num_key_value_heads": heads, "head_dim": R,
            "q_lora_rank": m.int("attention.q_lora_rank", 0, minimum=0) or None,
            "kv_lora_rank": m.int("attention.kv_lora_rank"), "qk_nope_head_dim": k_mla - R, "qk_rope_head_dim": R,
            "v_head_dim": m.int("attention.value_length_mla", m.int("attention.value_length")),
            "rope_interleave": True, "attention_bias": "blk.0.attn_kv_a_mqa.bias" in tensors,
            "kv_b_split": "blk.0.attn_kv_b.weight" not in tensors, "rope_parameters": _gguf_rope(m)}


def _gguf_rope(m) -> dict[str, Any]:
    """The rope as llama.cpp's deepseek2 graph computes it. YaRN: the converter stores 0.1 * mscale_all_dim as
    yarn_log_multiplier and not mscale, which llama.cpp takes equal to it: cos/sin unscaled, the softmax scaled by
    mscale(factor, mscale_all_dim)^2 -- transformers' math where mscale == mscale_all_dim (DeepSeek-V3's 1.0 and
    1.0). Without the key llama.cpp scales both: cos/sin by mscale(factor, 1), the softmax by its square."""
    rope = {"rope_theta": m.float("rope.freq_base", 10000.0, positive=True),
            **rope_scaling(m, GGUF.own_keys)}
    if rope["rope_type"] != "yarn":
        return rope
    if m.has("rope.scaling.yarn_log_multiplier"):
        mscale = m.float("rope.scaling.yarn_log_multiplier", positive=True) / 0.1
        return {**rope, "mscale": mscale, "mscale_all_dim": mscale}
    factor = rope["factor"]
    return {**rope, "mscale_all_dim": 1.0, "attention_factor": 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0}


GGUF = GGUFArch("deepseek2", tensors={
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"attn_{g}.{k}": f"self_attn.{h}.{k}" for g, h, k in (
        ("q", "q_proj", "weight"), ("q_a", "q_a_proj", "weight"), ("q_a", "q_a_proj", "bias"),
        ("q_a_norm", "q_a_layernorm", "weight"), ("q_b", "q_b_proj", "weight"),
        ("kv_a_mqa", "kv_a_proj_with_mqa", "weight"), ("kv_a_mqa", "kv_a_proj_with_mqa", "bias"),
        ("kv_a_norm", "kv_a_layernorm", "weight"), ("kv_b", "kv_b_proj", "weight"), ("k_b", "k_b_proj", "weight"),
        ("v_b", "v_b_proj", "weight"), ("output", "o_proj", "weight"), ("output", "o_proj", "bias"))},
    **GGUF_DENSE, **GGUF_SIGMOID_MOE,
}, config=_gguf_config, norm_topk_prob=False, own_keys=SIGMOID_ROUTER_KEYS | {"rope.scaling.yarn_log_multiplier"},
    latent_attention=True)


def layers(b: Build) -> list[PreNorm]:
    """Pre-norm layers of multi-head latent attention (layers/mla.py) and a sigmoid grouped-routed MoE block with
    shared experts, dense on the first first_k_dense_replace layers."""
    return [PreNorm(b, L, LatentAttention(b, L), moe_or_dense(b, L)) for L in range(b.spec.n_layers)]
