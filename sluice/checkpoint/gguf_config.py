"""GGUF metadata -> the Hugging Face config.json dict sluice's model files read (models/*.py `ModelArgs`).

The values are llama.cpp's: where a GGUF key is absent, the default is the one llama.cpp's loader uses for that
architecture, and fields llama.cpp does not compute (dense layers between MoE layers, sliding windows, a different
router normalisation than its graph hard-codes) are set so that sluice computes what llama.cpp computes on the file.

    GGUF (`{arch}.` prefix)               config.json                      notes
    block_count - nextn_predict_layers    num_hidden_layers                required; the blocks after the model's
                                                                           (an mtp head) are never read
    embedding_length                      hidden_size                      required
    attention.head_count                  num_attention_heads              required (a per-layer array must be uniform)
    attention.head_count_kv               num_key_value_heads              default head_count
    attention.key_length                  head_dim                         default hidden / heads; value_length and
                                                                           rope.dimension_count must equal it
    rope.dimension_count / key_length     partial_rotary_factor            where GGUFArch.partial_rope (the hybrids)
    attention.layer_norm_rms_epsilon      rms_norm_eps                     required
    context_length                        max_position_embeddings          required
    rope.freq_base                        rope_theta                       default 10000 (llama.cpp's)
    rope.scaling.{type,factor,            rope_parameters                  none / linear / yarn
      original_context_length,yarn_*}
    expert_count                          num_experts (num_local_experts)  required, > 0
    expert_used_count                     num_experts_per_tok              required, > 0
    expert_feed_forward_length            moe_intermediate_size            qwen*: default feed_forward_length /
                                                                           expert_used_count (llama.cpp's rule)
    feed_forward_length                   intermediate_size                olmoe / mixtral: the experts' size
    expert_shared_feed_forward_length     shared_expert_intermediate_size  qwen2moe; default feed_forward_length
    (hard-coded by llama.cpp's graph)     norm_topk_prob                   qwen3moe true, qwen2moe false, olmoe false,
                                                                           mixtral (always renormalises) true; an
                                                                           expert_weights_norm that says otherwise
                                                                           is a ConfigError
    tokenizer.ggml.tokens (length)        vocab_size                       else {arch}.vocab_size, else token_embd rows
    tokenizer.ggml.{bos,eos}_token_id     bos_token_id, eos_token_id
    `output.weight` absent                tie_word_embeddings = true
    attention.sliding_window              (not applied)                    llama.cpp's graphs for these four
                                                                           architectures attend to the whole context
    `blk.0.attn_q.bias` present           qkv_bias (qwen2moe)

Architectures: each models/<model_type>.py names its llama.cpp architecture and adds its own keys (`GGUF`, a
gguf_arch.GGUFArch; None when llama.cpp has none; the opener hands this module the table of them): qwen3moe ->
qwen3_moe, qwen2moe -> qwen2_moe, olmoe -> olmoe, llama with expert_count > 0 -> mixtral, qwen3next -> qwen3_next,
qwen35moe -> qwen3_5_moe (the hybrids' ssm.* keys: models/qwen3_next.py hybrid_gguf_config), qwen4exp -> qwen4_exp
(hyper_connection.*, attention.indexer.*, attention.compress_ratios, ple.*: models/qwen4_exp.py), gpt-oss ->
gpt_oss (its sliding window and pattern), glm4moe -> glm4_moe and deepseek2 -> deepseek_v3 (the sigmoid router's
keys, dense leading layers, shared experts: models/arch.py sigmoid_router_gguf_config; deepseek2's latent attention
sizes and YaRN scales, where head_count_kv / key_length / value_length describe llama.cpp's one-head view of the
latent: GGUFArch.latent_attention). Keys whose math sluice does not compute (another gating function, an expert
weight scale, an attention scale, longrope) are a ConfigError naming the key, never silently dropped.
"""

from __future__ import annotations

import struct
from typing import Any

from ..errors import CheckpointError, ConfigError
from .gguf import INTEGER_TYPES, GGUFFile
from .gguf_arch import GGUFArch, GGUFArchs
from .ref import TensorRef

_MISSING = object()


def _shortest_f32(x: float) -> float:
    """The shortest decimal that rounds to the same float32 as `x`: GGUF stores config floats as f32, and this is the
    value the converter started from in practice (1e-06, not 9.999999974752427e-07). Exact in float32 either way."""
    if x != x or x in (float("inf"), float("-inf")):
        return x
    packed = struct.pack("<f", x)
    for digits in range(1, 10):
        y = float(f"{x:.{digits}g}")
        if struct.pack("<f", y) == packed:
            return y
    return x


class GGUFMeta:
    """Typed access to one file's metadata; errors name the key and the file. Names without a `general.`,
    `tokenizer.` or `split.` prefix get the architecture's (`block_count` -> `qwen3moe.block_count`). A missing key
    is a CheckpointError unless a default is given; `REQUIRED` as the default makes it required too (for defaults
    computed from other keys that may come out empty)."""

    REQUIRED = _MISSING

    def __init__(self, gf: GGUFFile, arch: str):
        self.gf, self.arch, self.file = gf, arch, str(gf.path)

    def key(self, name: str) -> str:
        return name if "." in name and name.split(".", 1)[0] in ("general", "tokenizer", "split") else \
            f"{self.arch}.{name}"

    def has(self, name: str) -> bool:
        return self.key(name) in self.gf.metadata

    def missing(self, key: str) -> CheckpointError:
        model = "GGUF model" if self.arch == "general" else f"{self.arch} GGUF"
        return CheckpointError(f"metadata {key} is missing; a {model} needs it (re-convert the model with "
                               "llama.cpp's convert_hf_to_gguf.py)", file=self.file)

    def wrong(self, key: str, want: str) -> CheckpointError:
        return CheckpointError(f"metadata {key} must be {want}, got a {self.gf.type_of(key)} "
                               f"({self.gf.metadata[key]!r:.80}); the file is malformed", file=self.file)

    def int(self, name: str, default: Any = _MISSING, minimum: int = 1) -> int:
        """An integer >= `minimum`; a per-layer array is accepted when all its values are equal."""
        key = self.key(name)
        if key not in self.gf.metadata:
            if default is _MISSING:
                raise self.missing(key)
            return default
        v, t = self.gf.metadata[key], self.gf.types[key]
        if t not in INTEGER_TYPES:
            if not (t == 9 and self.gf.array_types.get(key) in INTEGER_TYPES and v):
                raise self.wrong(key, "an integer")
            if len(set(v)) != 1:
                raise ConfigError(f"{self.file}: metadata {key} varies per layer ({v[:8]}...); sluice needs one value")
            v = v[0]
        if v < minimum:
            raise ConfigError(f"{self.file}: metadata {key} is {v}; it must be >= {minimum}")
        return v

    def float(self, name: str, default: Any = _MISSING, positive: bool = False) -> float:
        """A float (f32 values as their shortest decimal); `positive`: finite and > 0 (eps, theta, factors)."""
        key = self.key(name)
        if key not in self.gf.metadata:
            if default is _MISSING:
                raise self.missing(key)
            return default
        v, t = self.gf.metadata[key], self.gf.types[key]
        if t in (6, 12):
            v = _shortest_f32(v) if t == 6 else v
        elif t in INTEGER_TYPES:
            v = float(v)
        else:
            raise self.wrong(key, "a number")
        if positive and not 0 < v < float("inf"):
            raise ConfigError(f"{self.file}: metadata {key} is {v}; it must be a finite number > 0")
        return v

    def bool(self, name: str, default: Any = _MISSING) -> bool:
        key = self.key(name)
        if key not in self.gf.metadata:
            if default is _MISSING:
                raise self.missing(key)
            return default
        if self.gf.types[key] != 7:
            raise self.wrong(key, "a bool")
        return self.gf.metadata[key]

    def str(self, name: str, default: Any = _MISSING) -> str:
        key = self.key(name)
        if key not in self.gf.metadata:
            if default is _MISSING:
                raise self.missing(key)
            return default
        if self.gf.types[key] != 8:
            raise self.wrong(key, "a string")
        return self.gf.metadata[key]


def gguf_arch(gf: GGUFFile, archs: GGUFArchs) -> GGUFArch:
    """The facts (of `archs`: general.architecture -> GGUFArch) of the file's general.architecture; ConfigError
    listing the supported ones when sluice has none, or when the architecture's `accept` refuses the file (a llama
    GGUF without experts)."""
    name = GGUFMeta(gf, "general").str("general.architecture")
    facts = archs.get(name)
    if facts is None:
        known = ", ".join(f"{a.name} ({a.model_type})" for a in archs.values())
        raise ConfigError(f"{gf.path}: GGUF architecture {name!r} is not supported; supported (llama.cpp's name and "
                          f"config.json model_type): {known}")
    if facts.accept is not None:
        facts.accept(GGUFMeta(gf, name))
    return facts


def gguf_config(gf: GGUFFile, tensors: dict[str, TensorRef], facts: GGUFArch) -> dict[str, Any]:
    """The config.json dict for the GGUF whose first file is `gf`, of architecture `facts` (gguf_arch), and whose
    tensors (GGUF names) are `tensors`: the keys every architecture reads the same, then the architecture's own (its
    GGUFArch.config hook)."""
    m = GGUFMeta(gf, facts.name)
    _refuse_unsupported(m, facts.norm_topk_prob, facts.own_keys)
    heads = m.int("attention.head_count")
    hidden = m.int("embedding_length")
    head_dim = m.int("attention.key_length", hidden // heads)
    same = () if facts.latent_attention else \
        ("attention.value_length",) + (() if facts.partial_rope else ("rope.dimension_count",))
    for other in same:
        if m.int(other, head_dim) != head_dim:
            raise ConfigError(f"{gf.path}: metadata {m.key(other)} is {m.int(other)} but the head size is {head_dim}; "
                              "llama.cpp's graph for this architecture (and sluice) needs them equal")
    n_experts, top_k = m.int("expert_count"), m.int("expert_used_count")
    if top_k > n_experts:
        raise ConfigError(f"{gf.path}: metadata {m.key('expert_used_count')} {top_k} exceeds "
                          f"{m.key('expert_count')} {n_experts}")
    theta = m.float("rope.freq_base", 10000.0, positive=True)
    cfg: dict[str, Any] = {
        "model_type": facts.model_type,
        "num_hidden_layers": n_layers(m),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": m.int("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": m.float("attention.layer_norm_rms_epsilon", positive=True),
        "max_position_embeddings": m.int("context_length"),
        "rope_theta": theta,
        "rope_parameters": {"rope_theta": theta, **rope_scaling(m, facts.own_keys)},
        "vocab_size": _vocab_size(m, tensors),
        "num_experts_per_tok": top_k,
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "norm_topk_prob": facts.norm_topk_prob,
    }
    if facts.partial_rope:
        cfg["partial_rotary_factor"] = _partial_rotary(m, head_dim)
    for name in ("bos", "eos"):
        if m.has(f"tokenizer.ggml.{name}_token_id"):
            cfg[f"{name}_token_id"] = m.int(f"tokenizer.ggml.{name}_token_id", minimum=0)
    cfg.update(facts.config(m, tensors))
    return cfg


def n_layers(m: GGUFMeta) -> int:
    """The model's decoder layers: block_count less the multi-token-prediction layers the converter appends after
    them (nextn_predict_layers, llama.cpp's rule: they are loaded for speculative decoding, never run by the main
    pass; sluice does not read them)."""
    blocks, mtp = m.int("block_count"), m.int("nextn_predict_layers", 0, minimum=0)
    if mtp >= blocks:
        raise ConfigError(f"{m.file}: metadata {m.key('nextn_predict_layers')} is {mtp} of {blocks} blocks; the file "
                          "holds no decoder layer to run (a multi-token-prediction head alone?)")
    return blocks - mtp


def _partial_rotary(m: GGUFMeta, head_dim: int) -> float:
    """partial_rotary_factor of rope.dimension_count rotary dims per head (llama.cpp's n_rot), checked to give back
    the same count by transformers' int(head_dim * factor)."""
    dims = m.int("rope.dimension_count", head_dim)
    factor = dims / head_dim
    if dims > head_dim or dims % 2 or int(head_dim * factor) != dims:
        raise ConfigError(f"{m.file}: metadata {m.key('rope.dimension_count')} is {dims}; with heads of {head_dim} "
                          "it must be an even count of at most the head size")
    return factor


def bools(m: GGUFMeta, name: str, length: int) -> list[bool] | None:
    """The first `length` values of a per-block array of bools (or 0 / 1 integers), or None when the key is absent;
    CheckpointError when it is not such an array or is shorter."""
    key = m.key(name)
    if key not in m.gf.metadata:
        return None
    v = m.gf.metadata[key]
    if m.gf.types[key] != 9 or m.gf.array_types.get(key) not in (7, *INTEGER_TYPES) or len(v) < length \
            or any(x not in (0, 1) for x in v):
        raise m.wrong(key, f"an array of at least {length} bools")
    return [bool(x) for x in v[:length]]


def ints(m: GGUFMeta, name: str, length: int | None = None, default: Any = _MISSING,
         per_layer: bool = False) -> list[int]:
    """An array of integers (`length` of them when given; `per_layer`: a single integer counts for all `length`, as
    llama.cpp's get_key_or_arr reads per-layer keys); CheckpointError naming the key when it is missing (and no
    default is given) or is anything else."""
    key = m.key(name)
    if key not in m.gf.metadata:
        if default is _MISSING:
            raise m.missing(key)
        return default
    v, t = m.gf.metadata[key], m.gf.types[key]
    if t in INTEGER_TYPES and per_layer and length is not None:
        return [v] * length
    want = f"an array of {length} integers" if length is not None else "an array of integers"
    if t != 9 or m.gf.array_types.get(key) not in INTEGER_TYPES or (length is not None and len(v) != length):
        raise m.wrong(key, want)
    return list(v)


def _refuse_unsupported(m: GGUFMeta, norm: bool, own_keys: frozenset[str]) -> None:
    """Keys that would change the math in a way sluice's model files do not compute, or that contradict what llama.cpp's
    graph for the architecture hard-codes (`norm`: its top-k renormalisation; its loaders for the softmax-routed
    architectures read none of the expert_* router keys below; neither does transformers' GGUF loader): refuse rather
    than guess which one the file means. `own_keys`: the ones the architecture's config hook reads itself."""
    if "expert_weights_norm" not in own_keys and m.bool("expert_weights_norm", norm) != norm:
        raise ConfigError(f"{m.file}: metadata {m.key('expert_weights_norm')} is {not norm}, but llama.cpp's {m.arch} "
                          f"graph always computes it as {norm} (and so do transformers and sluice); not supported")
    # 1: LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
    if "expert_gating_func" not in own_keys and m.int("expert_gating_func", 1, minimum=0) != 1:
        raise ConfigError(f"{m.file}: metadata {m.key('expert_gating_func')} selects a router other than softmax; "
                          "sluice's models route with softmax")
    # 0 is llama.cpp's "unset"
    if "expert_weights_scale" not in own_keys and m.float("expert_weights_scale", 1.0) not in (0.0, 1.0):
        raise ConfigError(f"{m.file}: metadata {m.key('expert_weights_scale')} scales the expert weights; "
                          "not supported")
    if m.float("attention.scale", 0.0) != 0.0:
        raise ConfigError(f"{m.file}: metadata {m.key('attention.scale')} sets a custom attention scale; "
                          "not supported")


def rope_scaling(m: GGUFMeta, own_keys: frozenset[str]) -> dict[str, Any]:
    """rope_parameters' keys beside rope_theta (rope_type, factor, yarn's); the YaRN keys in `own_keys` are left to
    the architecture's config hook, the others refused."""
    kind = m.str("rope.scaling.type", "none")
    linear = m.float("rope.scale_linear", 1.0, positive=True)  # the older key for linear scaling
    if kind == "none" and linear == 1.0:
        return {"rope_type": "default"}
    if kind == "linear" or (kind == "none" and linear != 1.0):
        return {"rope_type": "linear", "factor": m.float("rope.scaling.factor", linear, positive=True)}
    if kind == "yarn":
        for key in ("rope.scaling.yarn_ext_factor", "rope.scaling.yarn_log_multiplier", "rope.scaling.attn_factor"):
            if m.has(key) and key not in own_keys:
                raise ConfigError(f"{m.file}: metadata {m.key(key)} is not supported with sluice's YaRN rope")
        out = {"rope_type": "yarn", "factor": m.float("rope.scaling.factor", positive=True),
               "original_max_position_embeddings": m.int("rope.scaling.original_context_length")}
        for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                        ("yarn_attn_factor", "attention_factor")):
            if m.has(f"rope.scaling.{key}"):
                out[hf] = m.float(f"rope.scaling.{key}")
        return out
    raise ConfigError(f"{m.file}: metadata {m.key('rope.scaling.type')} is {kind!r}; supported: none, linear, yarn")


def _vocab_size(m: GGUFMeta, tensors: dict[str, TensorRef]) -> int:
    key = "tokenizer.ggml.tokens"
    if key in m.gf.metadata:
        if m.gf.types[key] != 9 or m.gf.array_types.get(key) != 8:
            raise m.wrong(key, "an array of strings")
        return len(m.gf.metadata[key])
    if m.has("vocab_size"):
        return m.int("vocab_size")
    embed = tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise CheckpointError("has no tokenizer.ggml.tokens, no vocab_size and no 2-D token_embd.weight: the "
                              "vocabulary size is unknown", file=m.file)
    return embed.shape[0]
