"""gpt-oss (`model_type: gpt_oss`): GQA with q/k/v/o biases and attention sinks (a learned logit per head that joins
each query's softmax), sliding-window (`sliding_window`, 128) and full attention alternating by `layer_types`, yarn
rope, a router with a bias whose weights are a softmax over the top-k logits only, and experts with biases whose
gate and up projections are interleaved in one `gate_up` weight and combined by a clamped, offset SwiGLU
((clamp(up, +-limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)).

Experts as shipped are MXFP4 (`mlp.experts.gate_up_proj_blocks/_scales`, `down_proj_blocks/_scales`) plus bf16
biases; the dequantized layout `save_pretrained` writes (`gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`) loads
too. store/layout.py's BiasedGluFormat holds either in a slot; models/layers/experts.py computes from it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

from ..checkpoint.index import CheckpointIndex
from ..errors import CheckpointError, ConfigError
from ..io.ranges import ReadRange
from ..quant import QuantSpec, UnsupportedFormat
from ..store.layout import PLAIN, BiasedGluFormat, ExpertLayout, ExpertPart, shaped
from ..checkpoint.gguf_config import bools, n_layers
from .arch import GGUF_ATTN, GGUF_ATTN_PAIRS, GGUFArch, SynthDefaults, TensorName, attention_tensors
from .args import CONFIG, BaseArgs, sliding_windows
from .schema import cfg, override
from .spec import Spec
from .layers import Attention, Build, PreNorm, moe_or_dense

MODEL_TYPE = "gpt_oss"
MOE_PREFIXES = ("mlp",)
ROUTER = "router"  # the router is `mlp.router.weight` / `.bias` (store/layout.py moe_prefix)
# no per-expert layout exists for gpt-oss; the names of its fused projections (tools/gguf_export, tools/inflate read
# these only for the per-expert layout, which store/layout.py never takes for these checkpoints)
EXPERT_PROJ = ("gate_up_proj", "gate_up_proj", "down_proj")
MLX_MOE = "mlp"  # mlx-lm's name of the MoE block (tools/mlx_export.py)
MLX_VALUES: dict[str, str] = {}  # mlx-lm's converter keeps the values
synth_wrap = None  # make-model writes the text model alone
INTERMEDIATE_KEY = "intermediate_size"
LAYER_TYPES = ("full_attention", "sliding_attention")
#: transformers' GptOssConfig rope when config.json gives none
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


@dataclass(kw_only=True)
class ModelArgs(BaseArgs):
    intermediate_size: int = cfg(ge=1)  # one expert's
    head_dim: int | None = override(BaseArgs, "head_dim", 64)  # GptOssConfig's default when config.json has none
    rms_norm_eps: float = override(BaseArgs, "rms_norm_eps", 1e-5)
    max_position_embeddings: int = override(BaseArgs, "max_position_embeddings", 131072)
    attention_bias: bool = cfg(True)
    sliding_window: int | None = cfg(128, ge=1)  # on the layers layer_types marks sliding_attention
    layer_types: list[str] | None = cfg(None, choices=LAYER_TYPES, length="num_hidden_layers")
    swiglu_limit: float = cfg(7.0, gt=0)
    swiglu_alpha: float = cfg(1.702, gt=0)  # hub configs omit it (transformers hard-coded 1.702 before v5)

    DEFAULT_THETA = 150000.0

    @classmethod
    def from_dict(cls, config: dict, source: str | os.PathLike[str] = CONFIG):
        """As BaseArgs', with transformers' default yarn rope when config.json has neither rope_scaling nor
        rope_parameters."""
        if isinstance(config, dict) and not config.get("rope_scaling") and not config.get("rope_parameters"):
            config = {**config, "rope_parameters": dict(DEFAULT_ROPE)}
        return super().from_dict(config, source)

    def config_problems(self) -> Iterator[tuple[str, str]]:
        for field, problem in super().config_problems():
            if field == "hidden_size" and "head_dim" not in self.config:
                continue  # head_dim absent means 64 here, not hidden_size / heads
            yield field, problem

    def spec(self) -> Spec:
        n = self.num_hidden_layers
        # GptOssConfig's default: even layers (0, 2, ...) slide, odd ones attend to everything
        layer_types = self.layer_types or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        return self.base_spec(
            moe_intermediate_size=self.intermediate_size,
            sliding_window=sliding_windows(n, self.sliding_window, layer_types),
            router="topk_softmax",
            qkv_bias=self.attention_bias,
            o_bias=self.attention_bias,
            attn_sinks=True,
            swiglu_limit=self.swiglu_limit,
            swiglu_alpha=self.swiglu_alpha,
        )


def layer_tensors(spec: Spec, layer: int, moe: str | None) -> list[TensorName]:
    """One decoder layer's resident tensors: q/k/v/o with biases, the sinks [nH], the norms, the router and its bias
    (the experts, biases included, are streamed)."""
    s = spec
    H = s.hidden_size
    p = f"model.layers.{layer}"
    a = f"{p}.self_attn"
    out = [TensorName("input_norm", f"{p}.input_layernorm.weight", (H,), "norm"), *attention_tensors(spec, layer)]
    out.append(TensorName("sinks", f"{a}.sinks", (s.n_heads,), "bias"))
    out.append(TensorName("post_norm", f"{p}.post_attention_layernorm.weight", (H,), "norm"))
    out.append(TensorName("router", f"{moe}.router.weight", (s.num_experts, H), "proj"))
    out.append(TensorName("router_bias", f"{moe}.router.bias", (s.num_experts,), "bias"))
    return out


# -- synthetic checkpoints (tools/synth.py) --------------------------------------------------------------------------
# gpt-oss-20b: 32 experts top-4, intermediate 2880 / hidden 2880, 24 layers; 32 top-4 here.
SYNTH = SynthDefaults("GptOssForCausalLM", num_experts=32, top_k=4, rope_theta=150000.0, rms_norm_eps=1e-5,
                      intermediate_multiple=32)


def synth_config(sc) -> dict[str, Any]:
    """config.json keys of a synthetic gpt_oss: MXFP4 experts as shipped (`quantization_config`), alternating
    sliding (128) and full attention, yarn rope as gpt-oss-20b's. ConfigError when H or I are not whole MXFP4
    groups of 32."""
    for name in ("hidden_size", "moe_intermediate_size"):
        if getattr(sc, name) % 32:
            raise ConfigError(f"{name}: {getattr(sc, name)} is not a multiple of 32; gpt_oss experts are MXFP4, "
                              "stored in groups of 32 along each row")
    return dict(num_local_experts=sc.num_experts, intermediate_size=sc.moe_intermediate_size, attention_bias=True,
                sliding_window=128, swiglu_limit=7.0,
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(sc.num_layers)],
                rope_scaling={**DEFAULT_ROPE, "rope_theta": SYNTH.rope_theta},
                quantization_config={"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]})


def synth_expert_nbytes(sc) -> int:
    """Bytes of one MXFP4 expert with its biases: 17 bytes per 32 weights (4.25 bits), biases in sc.dtype."""
    H, I = sc.hidden_size, sc.moe_intermediate_size
    return 3 * H * I * 17 // 32 + (2 * I + H) * sc.itemsize


def synth_experts(sc, draw: Callable, generator, prefix: str) -> Iterator[tuple[str, Any]]:
    """One MoE layer's experts as shipped: MXFP4 blocks (random codes) and E8M0 scales sized so the weights have
    std ~ sc.init_std (uniform e2m1 codes have std ~2.93 times the scale), then the biases (`draw`, "bias")."""
    import torch

    H, I, E = sc.hidden_size, sc.moe_intermediate_size, sc.num_experts
    exponent = 127 + round(math.log2(sc.init_std / 2.93))
    for name, out_f, in_f in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
        blocks = torch.randint(0, 256, (E, out_f, in_f // 32, 16), dtype=torch.uint8, generator=generator)
        yield f"{prefix}.{name}_blocks", blocks
        scales = exponent + torch.randint(-1, 2, (E, out_f, in_f // 32), generator=generator)
        yield f"{prefix}.{name}_scales", scales.to(torch.uint8)
        yield f"{prefix}.{name}_bias", draw((E, out_f if name == "gate_up_proj" else H), "bias")


# -- GGUF (checkpoint/gguf_config.py) --------------------------------------------------------------------------------
#: what llama.cpp's gpt-oss graph hard-codes for the clamped SwiGLU (its LLM_FFN_SWIGLU_OAI_MOE: alpha 1.702, limit 7)
GGUF_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}


def _gguf_config(m, tensors) -> dict[str, Any]:
    """llama.cpp's gpt-oss keys: the experts' size, the window and which layers slide (sliding_window_pattern, an
    array of bools or a period whose last layer attends to everything; absent: 2, even layers slide), biases on q/k/v/o,
    the SwiGLU constants of its graph; a separate rope base for the sliding layers is refused."""
    n = n_layers(m)
    if m.float("rope.freq_base_swa", m.float("rope.freq_base", 10000.0)) != m.float("rope.freq_base", 10000.0):
        raise ConfigError(f"{m.file}: metadata {m.key('rope.freq_base_swa')} gives the sliding layers another rope "
                          "base; sluice runs one rope for all layers")
    slide = bools(m, "attention.sliding_window_pattern", n) if m.gf.types.get(
        m.key("attention.sliding_window_pattern")) == 9 else None
    if slide is None:
        period = m.int("attention.sliding_window_pattern", 2, minimum=0)
        slide = [period == 0 or i % period < period - 1 for i in range(n)]
    return dict(num_experts=m.int("expert_count"), intermediate_size=m.int("expert_feed_forward_length"),
                sliding_window=m.int("attention.sliding_window"), attention_bias=True, **GGUF_SWIGLU,
                layer_types=[LAYER_TYPES[1] if x else LAYER_TYPES[0] for x in slide])


# llama.cpp's names: q/k/v/o with biases, the sinks, its post-attention norm, the router with its bias, and the
# experts as three stacks (gate and up apart, their rows un-interleaved by the converter; MXFP4 in its GGUF block
# type as the converter repacks them) with a bias each: expert_layer above reads them
GGUF = GGUFArch("gpt-oss", tensors={
    **GGUF_ATTN, **{f"attn_{g}.bias": f"self_attn.{h}_proj.bias" for g, h in GGUF_ATTN_PAIRS},
    "attn_sinks.weight": "self_attn.sinks", "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias",
    **{f"ffn_{p}_exps.{k}": f"mlp.experts.{p}_proj{'' if k == 'weight' else '_bias'}"
       for p in ("gate", "up", "down") for k in ("weight", "bias")},
}, config=_gguf_config, norm_topk_prob=False)


def layers(b: Build) -> list[PreNorm]:
    """Pre-norm layers of grouped-query attention with sinks (layers/sinks.py; sliding on every other layer) and a
    top-k-softmax-routed MoE block of biased, clamped SwiGLU experts."""
    return [PreNorm(b, L, Attention(b, L), moe_or_dense(b, L)) for L in range(b.spec.n_layers)]


# -- experts: how the checkpoint stores them (store/layout.py reads them through this) --------------------------------
def expert_layer(layout: ExpertLayout, index: CheckpointIndex, p: str, layer: int) -> str:
    """Where layer's experts are (store/layout.py calls this for the architecture): one BiasedGluFormat slot per
    expert from MXFP4 `*_blocks` / `*_scales` as shipped, the dequantized [E, in, out] `save_pretrained` writes, or
    a GGUF's stacked gate / up / down with a bias each (GGUF below), plus the biases; expert e is one contiguous slice
    of each tensor. Returns the layout's kind ("fused", "stacked" for a GGUF)."""
    s = layout.spec
    E, H, I = s.num_experts, s.hidden_size, s.moe_intermediate_size
    x = f"{p}.experts"
    gguf = f"{x}.gate_proj" in index
    names = (("gate_proj_bias", (E, I)), ("up_proj_bias", (E, I))) if gguf else (("gate_up_proj_bias", (E, 2 * I)),)
    biases = [shaped(index[f"{x}.{n}"], shape) for n, shape in (*names, ("down_proj_bias", (E, H)))]
    for b in biases:
        if b.dtype not in PLAIN or (b is not biases[-1] and b.dtype != biases[0].dtype):
            raise CheckpointError(f"expert biases stored as {b.dtype}; expected F32, F16 or BF16 (gate's and up's "
                                  "alike: one [2I] bias in the slot)", file=b.path, tensor=b.name)
    try:
        gate_up, down, tensors = _expert_tensors(index, x, E, H, I, gguf)
    except (UnsupportedFormat, ValueError) as e:
        raise CheckpointError(f"gpt-oss experts: {e}", file=biases[0].path, tensor=f"{x}.gate_up_proj") from None
    fmt = layout.keep_format(layer, biases[0], BiasedGluFormat.of(
        gate_up, down, PLAIN[biases[0].dtype], PLAIN[biases[-1].dtype], H, I, transposed=gate_up.plain and not gguf,
        halves=gguf))
    if gguf:  # gate's rows, then up's: one [2I, H] weight of whole rows (and the two biases one [2I])
        (g, u), b = tensors[0], fmt.gate_up_bias.offset
        pieces = [("gate", g, 0), ("up", u, g.nbytes // E), ("gate_bias", biases[0], b),
                  ("up_bias", biases[1], b + biases[0].nbytes // E)]
    else:
        pieces = [(t.name.rsplit(".", 1)[-1], t, part.offset) for t, part in zip(tensors[0], gate_up.parts)]
        pieces.append(("gate_up_proj_bias", biases[0], fmt.gate_up_bias.offset))
    pieces += [("down" if gguf else t.name.rsplit(".", 1)[-1], t, fmt.down_offset + part.offset)
               for t, part in zip(tensors[1], down.parts)]
    pieces.append(("down_bias" if gguf else "down_proj_bias", biases[-1], fmt.down_bias.offset))
    for e in range(E):  # expert e: one contiguous slice of each tensor
        layout.add_expert(layer, e, [ExpertPart(name, dest, ReadRange(t.path, t.offset + e * (t.nbytes // E),
                                                                      t.nbytes // E))
                                     for name, t, dest in pieces])
    return "stacked" if gguf else "fused"


def _expert_tensors(index: CheckpointIndex, x: str, E: int, H: int, I: int, gguf: bool):
    """(gate_up QuantSpec, down QuantSpec, [the gate_up tensors, the down tensors]) of the experts under `x`; ValueError
    or UnsupportedFormat for a layout sluice cannot hold in one slot."""
    if gguf:  # llama.cpp's: gate [E, I, H] and up [E, I, H] of one ggml type, down [E, H, I]
        g, u = shaped(index[f"{x}.gate_proj"], (E, I, H)), shaped(index[f"{x}.up_proj"], (E, I, H))
        dn = shaped(index[f"{x}.down_proj"], (E, H, I))
        if u.dtype != g.dtype:
            raise ValueError(f"gate is {g.dtype} and up {u.dtype}; sluice runs them as one weight of one type")
        return QuantSpec.ggml(g.dtype, 2 * I, H), QuantSpec.ggml(dn.dtype, H, I), [[g, u], [dn]]
    if f"{x}.gate_up_proj_blocks" in index:  # MXFP4 as shipped: [E, out, in/32, 16] codes, [E, out, in/32]
        tensors = [[shaped(index[f"{x}.{n}_blocks"], (E, o, i // 32, 16), "U8"),
                    shaped(index[f"{x}.{n}_scales"], (E, o, i // 32), "U8")]
                   for n, o, i in (("gate_up_proj", 2 * I, H), ("down_proj", H, I))]
        return QuantSpec.mxfp4(2 * I, H), QuantSpec.mxfp4(H, I), tensors
    # dequantized: gate_up [E, H, 2I], down [E, I, H], kept [in, out] (BiasedGluFormat.transposed)
    gu, dn = shaped(index[f"{x}.gate_up_proj"], (E, H, 2 * I)), shaped(index[f"{x}.down_proj"], (E, I, H))
    if gu.dtype not in PLAIN or dn.dtype != gu.dtype:
        raise ValueError(f"expected both in one of F32, F16, BF16, got {gu.dtype} and {dn.dtype}")
    return QuantSpec.ggml(gu.dtype, H, 2 * I), QuantSpec.ggml(dn.dtype, I, H), [[gu], [dn]]
