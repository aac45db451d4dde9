"""What an architecture module provides besides its math, and the shared pieces most of them reuse.

Generic code reads these from the module `models.get_arch(model_type)` returns (see `models/__init__.py` for the
whole interface): `SynthDefaults` (tools/synth.py), `layer_tensors` (models/weights.py and tools/synth.py: the
checkpoint names of one decoder layer's resident tensors) and `GGUFArch` (defined in checkpoint/gguf_arch.py,
which reads files by it). No torch and no math here, so the loaders and tools can import it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from ..checkpoint.gguf_arch import GGUFArch  # noqa: F401  (re-exported: the architectures declare their GGUF facts)
from ..errors import ConfigError

if TYPE_CHECKING:
    from .spec import Spec


@dataclass(frozen=True)
class SynthDefaults:
    """What `sluice make-model --arch` needs beyond the SynthConfig's shape: the real family's defaults."""

    hf_class: str  # config.json `architectures`: the transformers class that loads the checkpoint
    num_experts: int  # experts per MoE layer and per token when the size rule picks them
    top_k: int
    rope_theta: float
    rms_norm_eps: float
    # writes a shared expert beside the routed ones (size: SynthConfig.shared_expert_intermediate_size, else one
    # routed expert's); the module's `synth_config` puts its size in config.json
    shared_expert: bool = False
    # the experts' intermediate size is a multiple of this (gpt_oss: 32, whole MXFP4 groups along down's rows)
    intermediate_multiple: int = 1
    # writes per-layer n-gram embedding tables whose size SynthConfig.ple_bytes sets (qwen4_exp; make-model
    # --ple-size)
    ngram_table: bool = False
    # added special tokens the family's tokenizer has beyond the trained tokenizer's three, which converters look up
    # by name (llama.cpp's glm4moe converter reads GLM's [gMASK], <|user|>, <|endoftext|>, <|observation|>)
    special_tokens: tuple[str, ...] = ()


class TensorName(NamedTuple):
    """One resident tensor of a decoder layer as the checkpoint names it."""

    role: str  # what the loader builds from it (models/weights.py): "q", "q_bias", "router", "shared.gate", ...
    name: str  # the checkpoint's name, e.g. model.layers.3.self_attn.q_proj.weight
    shape: tuple[int, ...]
    init: str  # how a synthetic checkpoint draws it: "norm" (1 + noise), "proj" or "bias" (noise)


@dataclass(frozen=True)
class SynthWrap:
    """What a synthetic checkpoint holds around the text model when the family ships one (an architecture's
    `synth_wrap`): tools/synth.py writes `config` as config.json, the text model's `model.*` tensors under `prefix`,
    then `extra` (drawn like the others; roles starting "experts" count as expert bytes, roles starting "table" as
    row-table bytes: qwen4_exp's n-gram tables, which the model reads), then `fixed` as given. Reading such a
    checkpoint needs none of the rest: checkpoint/multimodal.py presents the text model, and nothing reads the
    vision tower or an mtp head."""

    config: dict
    prefix: str = "model."  # the hub's multimodal wrapper: "model.language_model."
    extra: list[TensorName] = field(default_factory=list)  # a vision tower, a multi-token-prediction head, ...
    fixed: list = field(default_factory=list)  # (name, tensor): values the checkpoint holds as they are (hashes)


def layer_tensors(spec: Spec, layer: int, moe: str | None) -> list[TensorName]:
    """The resident (non-expert) tensors of decoder layer `layer` of a Qwen / Mixtral / OLMoE style checkpoint, in
    the order a synthetic checkpoint writes them. `moe`: the MoE block's prefix in this checkpoint (e.g.
    `model.layers.3.mlp`, Mixtral's hub files `...block_sparse_moe`); unused on a dense layer.

    What the Spec turns on: q/k/v biases (qkv_bias), o bias (o_bias), q/k RMSNorm per head (qk_norm "head": [D]) or
    over the whole projection ("full": [heads*D]), a shared expert with its sigmoid gate, a dense MLP on layers
    moe_layers marks False.
    """
    s = spec
    H, D = s.hidden_size, s.head_dim
    qd, kvd = s.n_heads * D, s.n_kv_heads * D
    p = f"model.layers.{layer}"
    a = f"{p}.self_attn"
    out = [TensorName("input_norm", f"{p}.input_layernorm.weight", (H,), "norm"), *attention_tensors(spec, layer)]
    if s.qk_norm != "none":
        head = s.qk_norm == "head"
        out += [TensorName("q_norm", f"{a}.q_norm.weight", (D,) if head else (qd,), "norm"),
                TensorName("k_norm", f"{a}.k_norm.weight", (D,) if head else (kvd,), "norm")]
    out.append(TensorName("post_norm", f"{p}.post_attention_layernorm.weight", (H,), "norm"))
    return out + ffn_tensors(spec, layer, moe, p)


def ffn_tensors(spec: Spec, layer: int, moe: str | None, p: str) -> list[TensorName]:
    """The feed-forward block's resident tensors of layer `layer` (prefix `p`): a sparse layer's router, shared expert
    and its sigmoid gate under `moe`; a dense layer's MLP."""
    s, H = spec, spec.hidden_size
    if not s.moe_layers[layer]:
        return mlp_tensors("mlp.", f"{p}.mlp", s.dense_intermediate_size, H)
    out = [TensorName("router", f"{moe}.gate.weight", (s.num_experts, H), "proj")]
    if s.shared_expert_intermediate_size:
        out += mlp_tensors("shared.", f"{moe}.shared_expert", s.shared_expert_intermediate_size, H)
        out.append(TensorName("shared_gate", f"{moe}.shared_expert_gate.weight", (1, H), "proj"))
    return out


def final_tensors(spec: Spec) -> list[TensorName]:
    """The resident tensors after the last decoder layer, before the head: the final norm (every architecture but
    qwen4_exp, whose module defines its own `final_tensors`: the hyper-connections' final mixer)."""
    return [TensorName("norm", "model.norm.weight", (spec.hidden_size,), "norm")]


def final_of(module, spec: Spec) -> list[TensorName]:
    """The final tensors of architecture `module`: its own `final_tensors` when it has one, else the final norm."""
    return getattr(module, "final_tensors", final_tensors)(spec)


def attention_tensors(spec: Spec, layer: int) -> list[TensorName]:
    """q/k/v/o projections of layer `layer` under `model.layers.N.self_attn`, with the biases the Spec turns on
    (qkv_bias, o_bias)."""
    s = spec
    H, D = s.hidden_size, s.head_dim
    qd, kvd = s.n_heads * D, s.n_kv_heads * D
    a = f"model.layers.{layer}.self_attn"
    out = []
    for key, dim in (("q", qd), ("k", kvd), ("v", kvd)):
        out.append(TensorName(key, f"{a}.{key}_proj.weight", (dim, H), "proj"))
        if s.qkv_bias:
            out.append(TensorName(f"{key}_bias", f"{a}.{key}_proj.bias", (dim,), "bias"))
    out.append(TensorName("o", f"{a}.o_proj.weight", (H, qd), "proj"))
    if s.o_bias:
        out.append(TensorName("o_bias", f"{a}.o_proj.bias", (H,), "bias"))
    return out


def mlp_tensors(role: str, prefix: str, inter: int, hidden: int) -> list[TensorName]:
    """A SwiGLU MLP's gate/up [inter, hidden] and down [hidden, inter] named `{prefix}.{gate,up,down}_proj.weight`."""
    return [TensorName(f"{role}{k}", f"{prefix}.{k}_proj.weight", shape, "proj")
            for k, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter)))]


# -- GGUF ------------------------------------------------------------------------------------------------------------
# llama.cpp's tensor names (blk.N.<suffix>) shared by the architectures here, -> transformers' names under the layer
GGUF_ATTN_PAIRS = (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))  # attn_{GGUF} -> self_attn.{HF}_proj
GGUF_ATTN = {f"attn_{g}.weight": f"self_attn.{h}_proj.weight" for g, h in GGUF_ATTN_PAIRS}
GGUF_EXPERTS = {  # the router and the stacked experts
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
}
GGUF_COMMON = {
    **GGUF_ATTN,
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **GGUF_EXPERTS,
}
# a shared expert and its sigmoid gate (stored [H]: read as transformers' [1, H], models/weights.py)
GGUF_SHARED = {"ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
               **{f"ffn_{p}_shexp.weight": f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")}}
GGUF_QK_NORM = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
GGUF_QKV_BIAS = {f"attn_{g}.bias": f"self_attn.{g}_proj.bias" for g in "qkv"}
# a dense layer's MLP (glm4moe's and deepseek2's first leading_dense_block_count layers)
GGUF_DENSE = {f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
# the grouped sigmoid router with its selection bias (exp_probs_b), the stacked experts and the ungated shared experts
# of glm4moe and deepseek2
GGUF_SIGMOID_MOE = {
    **GGUF_EXPERTS,
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    **{f"ffn_{p}_shexp.weight": f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")},
}
#: the router keys sigmoid_router_gguf_config reads (GGUFArch.own_keys)
SIGMOID_ROUTER_KEYS = frozenset({"expert_gating_func", "expert_weights_scale", "expert_weights_norm"})
_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def sigmoid_router_gguf_config(m, gating_default: int) -> dict:
    """config.json keys of a grouped-sigmoid-routed GGUF (glm4moe, deepseek2) as llama.cpp's loaders read them:
    expert_gating_func (absent: `gating_default`, the loader's) must be sigmoid; expert_weights_scale (0 or absent:
    none) is routed_scaling_factor, expert_weights_norm (absent: false) norm_topk_prob; expert groups (absent: one);
    the first leading_dense_block_count layers dense; expert_shared_count shared experts of the experts' size."""
    if m.int("expert_gating_func", gating_default, minimum=0) != _SIGMOID:
        raise ConfigError(f"{m.file}: metadata {m.key('expert_gating_func')} is absent or not sigmoid: a "
                          f"softmax-routed {m.arch} model (DeepSeek-V2), which sluice does not run")
    scale = m.float("expert_weights_scale", 0.0) or 1.0  # 0: llama.cpp's "unset"
    if not 0 < scale < float("inf"):
        raise ConfigError(f"{m.file}: metadata {m.key('expert_weights_scale')} is {scale}; it must be a finite number "
                          "> 0")
    groups = m.int("expert_group_count", 1)
    ff, top_k = m.int("feed_forward_length", 0, minimum=0), m.int("expert_used_count")
    return dict(num_experts=m.int("expert_count"), intermediate_size=ff,
                moe_intermediate_size=m.int("expert_feed_forward_length", ff // top_k or m.REQUIRED),
                n_shared_experts=m.int("expert_shared_count", 0, minimum=0),
                first_k_dense_replace=m.int("leading_dense_block_count", 0, minimum=0),
                n_group=groups, topk_group=m.int("expert_group_used_count", groups) if groups > 1 else 1,
                routed_scaling_factor=scale, norm_topk_prob=m.bool("expert_weights_norm", False))
