"""Qwen3-Next (`model_type: qwen3_next`, Qwen3-Next-80B-A3B): the Gated DeltaNet hybrid. Three of every four layers
(`layer_types`, else every `full_attention_interval`-th layer attends) are Gated DeltaNet linear attention
(models/layers/gated_deltanet.py) with Qwen3-Next's two fused input projections; the others gated full attention
(models/layers/gated_attention.py: q_proj gives queries and a sigmoid gate, per-head q / k norms, a quarter of each
head rotary). The feed-forward block: a softmax top-k MoE with a shared expert scaled by sigmoid(shared_expert_gate)
(qwen2_moe's), or a dense MLP on mlp_only_layers / decoder_sparse_step. Every RMSNorm but the Gated DeltaNet's
output norm is zero-centred (scale 1 + weight).

Checkpoint names under `model.layers.N.`: `linear_attn.{in_proj_qkvz, in_proj_ba, conv1d, dt_bias, A_log, norm,
out_proj}` or `self_attn.{q,k,v,o}_proj, q_norm, k_norm`; `mlp.gate`, `mlp.experts.*` (per expert on the hub, fused by
transformers>=5), `mlp.shared_expert.*`, `mlp.shared_expert_gate`. Hub checkpoints also hold a multi-token-prediction
head (`mtp.*`, speculative decoding): never read. The helpers here (HybridArgs, hybrid_tensors, the synthetic
config and mtp head) are shared with qwen3_5_moe, the same design with Qwen3.5's four separate projections.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..checkpoint.multimodal import text_config
from ..errors import ConfigError
from ..checkpoint.gguf_config import bools, n_layers
from .arch import (GGUF_ATTN, GGUF_EXPERTS, GGUF_QK_NORM, GGUF_SHARED, GGUFArch, SynthDefaults, SynthWrap, TensorName,
                   ffn_tensors)
from .args import CONFIG, MAX_HEAD_DIM, BaseArgs, moe_layer_flags
from .layers import Build, GatedAttention, GatedDeltaNet, PreNorm, moe_or_dense
from .schema import cfg, override
from .spec import DeltaNetSpec, Spec

MODEL_TYPE = "qwen3_next"
MOE_PREFIXES = ("mlp",)
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")
ROUTER = "gate"  # the router is `{prefix}.gate.weight` (store/layout.py moe_prefix)
MLX_MOE = "mlp"  # mlx-lm's name of the MoE block (tools/mlx_export.py)
#: llama.cpp's and mlx-lm's converters store these zero-centred norm weights w as their scale 1 + w
CENTRED_NORMS = {n: "plus_one" for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                         "model.norm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight")}
MLX_VALUES = CENTRED_NORMS  # mlx-lm's sanitize stores them so
synth_experts = synth_expert_nbytes = None  # make-model writes the per-expert / fused layouts
expert_layer = None  # store/layout.py reads the per-expert, fused or stacked expert layouts
INTERMEDIATE_KEY = "moe_intermediate_size"
LAYER_TYPES = ("linear_attention", "full_attention")
#: the input projections a checkpoint may store (HybridArgs.linear_in_proj) -> their DeltaNetWeights roles
IN_PROJ = {"qkv_z_b_a": ("qkv", "z", "b", "a"),  # Qwen3.5 (transformers, llama.cpp's qwen35moe)
           "qkvz_ba": ("qkvz", "ba"),  # Qwen3-Next (transformers; llama.cpp's first qwen3next files: ssm_in)
           "qkv_z_ba": ("qkv", "z", "ba")}  # llama.cpp's qwen3next (its converter splits in_proj_qkvz, keeps ba)
#: transformers' Qwen3NextConfig / Qwen3_5MoeTextConfig set partial_rotary_factor to this when config.json has none
DEFAULT_PARTIAL_ROTARY = 0.25


@dataclass(kw_only=True)
class HybridArgs(BaseArgs):
    """The config.json fields Qwen3-Next and Qwen3.5-MoE share (defaults: transformers', Qwen3-Next-80B-A3B's)."""

    moe_intermediate_size: int = cfg(ge=1)
    # required: transformers' default (512) is a size sluice must not guess
    shared_expert_intermediate_size: int = cfg(ge=0)  # 0: no shared expert
    head_dim: int | None = override(BaseArgs, "head_dim", 256)
    max_position_embeddings: int = override(BaseArgs, "max_position_embeddings", 32768)
    attention_bias: bool = cfg(False)  # q / k / v / o biases on the full-attention layers
    layer_types: list[str] | None = cfg(None, choices=LAYER_TYPES, length="num_hidden_layers")
    full_attention_interval: int = cfg(4, ge=1)  # without layer_types: every interval-th layer attends
    linear_conv_kernel_dim: int = cfg(4, ge=1, le=64)
    linear_key_head_dim: int = cfg(128, ge=1, le=MAX_HEAD_DIM)
    linear_value_head_dim: int = cfg(128, ge=1, le=MAX_HEAD_DIM)
    linear_num_key_heads: int = cfg(16, ge=1, divides="linear_num_value_heads")
    linear_num_value_heads: int = cfg(32, ge=1)
    # sluice's own keys, not transformers': how the checkpoint stores the linear attention. A GGUF's config says
    # what llama.cpp's converter wrote (the GGUF facts below); a Hugging Face or MLX folder keeps the defaults.
    # The value heads' order (models/layers/gated_deltanet.py): transformers' grouped by key head, or tiled
    linear_value_head_order: str = cfg("grouped", choices=("grouped", "tiled"))
    linear_in_proj: str = cfg("qkv_z_b_a", choices=tuple(IN_PROJ))  # the input projections stored (IN_PROJ)

    @classmethod
    def from_dict(cls, config: dict, source: str | os.PathLike[str] = CONFIG):
        """BaseArgs.from_dict, with transformers' partial_rotary_factor default of 0.25 when the file has none (one
        in rope_parameters still wins, as in transformers)."""
        config = text_config(config)
        if isinstance(config, dict) and config.get("partial_rotary_factor") is None:
            config = {**config, "partial_rotary_factor": DEFAULT_PARTIAL_ROTARY}
        return super().from_dict(config, source)

    def config_problems(self) -> Iterator[tuple[str, str]]:
        # head_dim defaults to 256, not hidden_size / num_attention_heads: their ratio sizes nothing here
        yield from ((f, m) for f, m in super().config_problems() if f != "hidden_size")

    def linear_layers(self) -> list[bool]:
        """Per layer: Gated DeltaNet (True) or full attention."""
        if self.layer_types is not None:
            return [t == "linear_attention" for t in self.layer_types]
        return [(i + 1) % self.full_attention_interval != 0 for i in range(self.num_hidden_layers)]

    def hybrid_spec(self, **arch) -> Spec:
        """The Spec of the shared design plus the architecture's own fields (`arch`)."""
        return self.base_spec(
            moe_intermediate_size=self.moe_intermediate_size,
            sliding_window=[None] * self.num_hidden_layers,
            shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            qkv_bias=self.attention_bias,
            o_bias=self.attention_bias,
            qk_norm="head",
            attn_gate=True,
            zero_centred_norms=True,
            delta=DeltaNetSpec(layers=self.linear_layers(), n_k_heads=self.linear_num_key_heads,
                               n_v_heads=self.linear_num_value_heads, k_head_dim=self.linear_key_head_dim,
                               v_head_dim=self.linear_value_head_dim, conv_kernel=self.linear_conv_kernel_dim,
                               tiled=self.linear_value_head_order == "tiled",
                               projections=IN_PROJ[self.linear_in_proj]),
            **arch,
        )


@dataclass(kw_only=True)
class ModelArgs(HybridArgs):
    intermediate_size: int = cfg(0, ge=0)  # dense layers only (required then: see config_problems)
    norm_topk_prob: bool = cfg(True)
    linear_in_proj: str = override(HybridArgs, "linear_in_proj", "qkvz_ba")  # in_proj_qkvz, in_proj_ba
    decoder_sparse_step: int = cfg(1, ge=1)
    mlp_only_layers: list[int] | None = cfg(None, ge=0, lt="num_hidden_layers")

    def moe_layers(self) -> list[bool]:
        return moe_layer_flags(self.num_hidden_layers, self.num_experts, self.decoder_sparse_step,
                               self.mlp_only_layers or [])

    def config_problems(self) -> Iterator[tuple[str, str]]:
        yield from super().config_problems()
        dense = [i for i, sparse in enumerate(self.moe_layers()) if not sparse]
        if dense and self.intermediate_size < 1:
            yield "intermediate_size", (
                f"{'got 0' if 'intermediate_size' in self.config else 'missing'}; layers {dense[:8]} are dense "
                "(mlp_only_layers / decoder_sparse_step), so their MLP size is needed: expected an integer >= 1")

    def spec(self) -> Spec:
        return self.hybrid_spec(dense_intermediate_size=self.intermediate_size, norm_topk_prob=self.norm_topk_prob)


# -- tensor names ----------------------------------------------------------------------------------------------------
#: Gated DeltaNet input projections: role -> (checkpoint name under linear_attn, rows as a function of DeltaNetSpec)
PROJECTIONS = {"qkvz": ("in_proj_qkvz", lambda d: 2 * d.key_dim + 2 * d.value_dim),
               "ba": ("in_proj_ba", lambda d: 2 * d.n_v_heads),
               "qkv": ("in_proj_qkv", lambda d: d.conv_dim), "z": ("in_proj_z", lambda d: d.value_dim),
               "b": ("in_proj_b", lambda d: d.n_v_heads), "a": ("in_proj_a", lambda d: d.n_v_heads)}


def hybrid_tensors(spec: Spec, layer: int, moe: str | None, at: str | None = None) -> list[TensorName]:
    """One hybrid decoder layer's resident tensors (the input projections the Spec says the checkpoint stores:
    DeltaNetSpec.projections), in file order, under `at` (default `model.layers.{layer}`). Zero-centred norms are
    drawn like biases by synthetic checkpoints (around 0: scale 1 + weight), the Gated DeltaNet's plain output norm
    like a norm (around 1)."""
    s, d = spec, spec.delta
    H, D = s.hidden_size, s.head_dim
    p = at or f"model.layers.{layer}"
    out = [TensorName("input_norm", f"{p}.input_layernorm.weight", (H,), "bias")]
    if s.attends(layer):
        a = f"{p}.self_attn"
        for key, rows in (("q", 2 * s.n_heads * D), ("k", s.n_kv_heads * D), ("v", s.n_kv_heads * D)):
            out.append(TensorName(key, f"{a}.{key}_proj.weight", (rows, H), "proj"))
            if s.qkv_bias:
                out.append(TensorName(f"{key}_bias", f"{a}.{key}_proj.bias", (rows,), "bias"))
        out.append(TensorName("o", f"{a}.o_proj.weight", (H, s.n_heads * D), "proj"))
        if s.o_bias:
            out.append(TensorName("o_bias", f"{a}.o_proj.bias", (H,), "bias"))
        out += [TensorName("q_norm", f"{a}.q_norm.weight", (D,), "bias"),
                TensorName("k_norm", f"{a}.k_norm.weight", (D,), "bias")]
    else:
        a = f"{p}.linear_attn"
        out += [TensorName(f"delta.{role}", f"{a}.{PROJECTIONS[role][0]}.weight", (PROJECTIONS[role][1](d), H), "proj")
                for role in d.projections]
        out += [TensorName("delta.conv", f"{a}.conv1d.weight", (d.conv_dim, 1, d.conv_kernel), "proj"),
                TensorName("delta.dt_bias", f"{a}.dt_bias", (d.n_v_heads,), "bias"),
                TensorName("delta.A_log", f"{a}.A_log", (d.n_v_heads,), "bias"),
                TensorName("delta.norm", f"{a}.norm.weight", (d.v_head_dim,), "norm"),
                TensorName("o", f"{a}.out_proj.weight", (H, d.value_dim), "proj")]
    out.append(TensorName("post_norm", f"{p}.post_attention_layernorm.weight", (H,), "bias"))
    return out + ffn_tensors(spec, layer, moe, p)


def layer_tensors(spec: Spec, layer: int, moe: str | None) -> list[TensorName]:
    return hybrid_tensors(spec, layer, moe)


# -- synthetic checkpoints (tools/synth.py) --------------------------------------------------------------------------
# Qwen3-Next-80B-A3B: 48 layers (every 4th full attention), hidden 2048, 16 heads of 256 (2 kv), a quarter rotary,
# linear attention 16 key heads / 32 value heads of 128, 512 experts top-10 of 512 plus a shared expert of 512.
SYNTH = SynthDefaults("Qwen3NextForCausalLM", num_experts=512, top_k=10, rope_theta=1e7, rms_norm_eps=1e-6,
                      shared_expert=True)


def hybrid_synth_config(sc) -> dict[str, Any]:
    """config.json keys both hybrids' synthetic checkpoints share, in the real models' proportions to the
    SynthConfig: linear attention with as many key heads as attention heads, twice as many value heads, head dims
    half the attention's (16 / 32 heads of 128 beside 16 heads of 256); every 4th layer full attention and, when
    the model has fewer than 4 layers, its last one (so every synthetic model has both kinds)."""
    if sc.head_dim < 2:
        raise ConfigError(f"head_dim: the hybrids' linear-attention heads are half the attention's: expected >= 2, "
                          f"got {sc.head_dim}")
    n = sc.num_layers
    interval = min(4, n)
    types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    return dict(num_experts=sc.num_experts, moe_intermediate_size=sc.moe_intermediate_size,
                shared_expert_intermediate_size=sc.shared_size, layer_types=types, full_attention_interval=interval,
                linear_conv_kernel_dim=4, linear_num_key_heads=sc.num_heads, linear_num_value_heads=2 * sc.num_heads,
                linear_key_head_dim=sc.head_dim // 2, linear_value_head_dim=sc.head_dim // 2, attention_bias=False,
                partial_rotary_factor=DEFAULT_PARTIAL_ROTARY)


def mtp_tensors(sc, spec: Spec) -> list[TensorName]:
    """The multi-token-prediction head the hub's checkpoints carry (`mtp.*`: one full-attention MoE layer behind a
    fusing projection of the embedding and the last hidden state), in the checkpoint's expert layout: written by
    synthetic checkpoints so they hold bytes that neither sluice nor transformers' *ForCausalLM ever reads."""
    H, E, I = spec.hidden_size, spec.num_experts, spec.moe_intermediate_size
    L = spec.delta.layers.index(False)  # the head's layer is shaped like a full-attention one
    moe, p = "mtp.layers.0.mlp", "mtp.layers.0"
    out = [TensorName("mtp.fc", "mtp.fc.weight", (H, 2 * H), "proj"),
           *(TensorName(f"mtp.{n}", f"mtp.{n}.weight", (H,), "bias") for n in ("pre_fc_norm_embedding",
                                                                                 "pre_fc_norm_hidden")),
           *hybrid_tensors(spec, L, moe, at=p)]
    if sc.layout == "fused":
        out += [TensorName("experts", f"{moe}.experts.gate_up_proj", (E, 2 * I, H), "proj"),
                TensorName("experts", f"{moe}.experts.down_proj", (E, H, I), "proj")]
    else:
        out += [TensorName("experts", f"{moe}.experts.{e}.{n}.weight", (H, I) if n == "down_proj" else (I, H), "proj")
                for e in range(E) for n in EXPERT_PROJ]
    return out + [TensorName("mtp.norm", "mtp.norm.weight", (H,), "bias")]


def synth_wrap(sc, spec: Spec, config: dict) -> SynthWrap:
    """A synthetic qwen3_next holds the hub's mtp head after the model."""
    return SynthWrap({**config, "mtp_num_hidden_layers": 1}, extra=mtp_tensors(sc, spec))


def synth_config(sc) -> dict[str, Any]:
    """config.json keys of a synthetic qwen3_next: hybrid_synth_config, every layer sparse, renormalised top-k."""
    return {**hybrid_synth_config(sc), "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
            "intermediate_size": 4 * sc.moe_intermediate_size}


# -- GGUF (checkpoint/gguf_config.py) --------------------------------------------------------------------------------
# What llama.cpp's convert_hf_to_gguf.py does to the hybrids, undone here: the norms transformers scales by 1 + w it
# stores as that scale (all but the Gated DeltaNet's own), A_log as -exp(A_log) (ssm_a), dt_bias renamed ssm_dt.bias,
# the conv squeezed to [C, K], the mtp head (without --no-mtp) as blocks after the model's (nextn_predict_layers),
# the rope's rotary part as rope.dimension_count. Qwen3-Next: in_proj_qkvz split into attn_qkv (q | k | v) and
# attn_gate (z), in_proj_ba kept (ssm_ba). Qwen3.5: the value heads reordered from grouped to tiled (qwen3_5_moe.py).
GGUF_HYBRID = {  # blk.N.<suffix> -> model.layers.N.<suffix>, both hybrids
    **GGUF_ATTN, **GGUF_QK_NORM, **GGUF_EXPERTS, **GGUF_SHARED,
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",  # [C, K]: read as [C, 1, K]
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",  # -exp(A_log)
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
GGUF_HYBRID_VALUES = {**CENTRED_NORMS, "linear_attn.A_log": "neg_exp"}


def hybrid_gguf_config(m, tensors) -> dict[str, Any]:
    """The config keys both hybrids' GGUFs give (llama.cpp's loaders: the ssm.* keys size the linear attention,
    attention.recurrent_layers or else full_attention_interval place it; every layer sparse, with a shared expert)."""
    n, top_k = n_layers(m), m.int("expert_used_count")
    ff = m.int("feed_forward_length", 0, minimum=0)
    k_heads, v_heads, inner = m.int("ssm.group_count"), m.int("ssm.time_step_rank"), m.int("ssm.inner_size")
    if inner % v_heads:
        raise ConfigError(f"{m.file}: metadata {m.key('ssm.inner_size')} {inner} is not a whole number of "
                          f"{m.key('ssm.time_step_rank')} {v_heads} value heads")
    linear = bools(m, "attention.recurrent_layers", n)
    if linear is None:
        interval = m.int("full_attention_interval", 4)
        linear = [(i + 1) % interval != 0 for i in range(n)]
    return dict(num_experts=m.int("expert_count"), moe_intermediate_size=m.int("expert_feed_forward_length",
                                                                              ff // top_k or m.REQUIRED),
                shared_expert_intermediate_size=m.int("expert_shared_feed_forward_length", ff or m.REQUIRED),
                layer_types=[LAYER_TYPES[0] if x else LAYER_TYPES[1] for x in linear],
                linear_conv_kernel_dim=m.int("ssm.conv_kernel"), linear_key_head_dim=m.int("ssm.state_size"),
                linear_num_key_heads=k_heads, linear_num_value_heads=v_heads, linear_value_head_dim=inner // v_heads,
                attention_bias=False)  # llama.cpp's graphs have no attention biases


def _gguf_config(m, tensors) -> dict[str, Any]:
    # the first qwen3next files kept in_proj_qkvz whole (ssm_in; llama.cpp still reads them)
    legacy = any(name.endswith(".ssm_in.weight") for name in tensors)
    return {**hybrid_gguf_config(m, tensors), "intermediate_size": m.int("feed_forward_length", 0, minimum=0),
            "decoder_sparse_step": 1, "mlp_only_layers": [], "linear_in_proj": "qkvz_ba" if legacy else "qkv_z_ba"}


GGUF = GGUFArch("qwen3next", tensors={**GGUF_HYBRID, "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
                                      "ssm_in.weight": "linear_attn.in_proj_qkvz.weight"},
                config=_gguf_config, norm_topk_prob=True, values=GGUF_HYBRID_VALUES, partial_rope=True)


def layers(b: Build) -> list[PreNorm]:
    """Pre-norm layers of Gated DeltaNet or gated attention (every layer_types "full_attention" one), each with a
    softmax-routed MoE block and its sigmoid-gated shared expert, or a dense MLP."""
    return [PreNorm(b, L, GatedAttention(b, L) if b.spec.attends(L) else GatedDeltaNet(b, L), moe_or_dense(b, L))
            for L in range(b.spec.n_layers)]
