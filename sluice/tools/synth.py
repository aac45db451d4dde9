"""Synthetic checkpoints of real MoE architectures: random weights at a requested size, written like a hub model.

Benchmarks and the demo need models of a chosen size (bigger than memory) without downloading one. A synthetic
checkpoint here is a Hugging Face folder that `transformers.AutoModelForCausalLM.from_pretrained` loads with no
missing or unexpected keys: config.json + generation_config.json, a byte-level BPE tokenizer with a ChatML template
(trained offline), and safetensors shards with the hub's tensor names.

Routing realism: with the usual small init (embeddings ~ N(0, 0.02)) nearly every token routes to the same few
experts (measured on a 16-layer, 64-expert, top-8 model: 11-24 of 64 experts used per layer over 32 tokens), which
flatters any expert cache. Embeddings ~ N(0, 4) spread routing to 60-64 of 64 per layer, like a trained model, so
that is the default (`embed_std`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError
from ..models import get_arch, supported
from ..models.arch import SynthWrap, TensorName, final_of
from ..models.args import MAX_LAYERS
from ..models.spec import Spec
from ..options import COMPUTE_DTYPES, format_bytes
from .output import OutputExistsError, writing_model  # noqa: F401  (OutputExistsError: make_model's error)

GiB = 2**30
LAYOUTS = ("per_expert", "fused")


@dataclass(frozen=True)
class SynthConfig:
    """The blueprint of a synthetic checkpoint. `config_for_size` fills it for a target size.

    arch:               config.json model_type (models.supported()); the family's defaults, names and config keys
                        are its module's (SYNTH, synth_config, layer_tensors, MOE_PREFIXES, EXPERT_PROJ).
    hidden_size, num_layers, num_heads, num_kv_heads, head_dim: the transformer's shape.
    num_experts, top_k: experts per MoE layer and experts per token.
    moe_intermediate_size: one expert's intermediate size (I): gate/up [I, H], down [H, I].
    vocab_size:         config.json vocab; may exceed the trained tokenizer's, as in real models.
    dtype:              bfloat16 | float32 | float16, for every tensor.
    embed_std:          std of the token embeddings; 4.0 spreads routing like a trained model (see module doc).
    init_std:           std of every projection, the router and lm_head (transformers' initializer_range).
    seed:               the same config and seed give byte-identical files.
    layout:             per_expert (the hub's `experts.{e}.gate_proj.weight`) | fused (`experts.gate_up_proj`);
                        an architecture with its own `synth_experts` writes its experts as shipped instead
                        (gpt_oss: MXFP4 blocks and scales plus biases).
    tie_word_embeddings: no lm_head tensor; the head is the embedding.
    max_shard_bytes:    shard size limit, like save_pretrained's max_shard_size.
    shared_expert_intermediate_size: the shared expert of an architecture that has one (qwen2_moe); None = one
                        routed expert's size (small, resident).
    ple_bytes:          the size of the per-layer n-gram tables of an architecture that has them (qwen4_exp; its
                        SYNTH.ngram_table), outside the size rule's target; None = a small table (~1 MiB at hidden 64).
    """

    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    vocab_size: int
    dtype: str = "bfloat16"
    embed_std: float = 4.0
    init_std: float = 0.02
    seed: int = 0
    layout: str = "per_expert"
    tie_word_embeddings: bool = False
    max_shard_bytes: int = GiB
    shared_expert_intermediate_size: int | None = None
    ple_bytes: int | None = None

    def __post_init__(self):
        if self.arch not in supported():
            raise ConfigError(f"arch: {self.arch!r} is not one of {', '.join(supported())}")
        if self.dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"dtype: {self.dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout: {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "num_experts", "top_k",
                     "moe_intermediate_size", "vocab_size", "max_shard_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"top_k: {self.top_k} exceeds num_experts {self.num_experts}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        if self.embed_std <= 0 or self.init_std <= 0:
            raise ConfigError("embed_std and init_std must be positive")
        shared = self.shared_expert_intermediate_size
        if shared is not None and (not isinstance(shared, int) or shared < 1):
            raise ConfigError(f"shared_expert_intermediate_size: must be a positive integer or None, got {shared!r}")
        if self.ple_bytes is not None:
            if not isinstance(self.ple_bytes, int) or self.ple_bytes < 1:
                raise ConfigError(f"ple_bytes: must be a positive integer or None, got {self.ple_bytes!r}")
            if not get_arch(self.arch).SYNTH.ngram_table:
                have = [t for t in supported() if get_arch(t).SYNTH.ngram_table]
                raise ConfigError(f"ple_bytes: {self.arch} has no n-gram embedding tables (those that do: "
                                  f"{', '.join(have)})")
        get_arch(self.arch).synth_config(self)  # the architecture's own checks (ConfigError)

    @property
    def shared_size(self) -> int:
        """Intermediate size of the shared expert (0: the architecture has none). Resolved here, not in
        __post_init__, so `dataclasses.replace(sc, moe_intermediate_size=...)` keeps following the routed experts'."""
        if not get_arch(self.arch).SYNTH.shared_expert:
            return 0
        if self.shared_expert_intermediate_size is None:
            return self.moe_intermediate_size
        return self.shared_expert_intermediate_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return COMPUTE_DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert of one layer (gate + up + down; the architecture's `synth_expert_nbytes` when it
        writes its experts itself, e.g. gpt_oss in MXFP4 with biases)."""
        own = get_arch(self.arch).synth_expert_nbytes
        if own is not None:
            return own(self)
        return 3 * self.hidden_size * self.moe_intermediate_size * self.itemsize


# -- shapes and sizes ------------------------------------------------------------------------------------------------
def _spec(sc: SynthConfig) -> Spec:
    """The Spec sluice reads from the checkpoint's config.json: which layers are sparse, which tensors each has
    (ConfigError naming the field for a shape sluice would refuse to load)."""
    return get_arch(sc.arch).ModelArgs.from_dict(text_config_json(sc)).spec()


def _wrap(sc: SynthConfig, spec: Spec | None = None) -> SynthWrap:
    """What the checkpoint holds around the text model (the architecture's synth_wrap; by default nothing)."""
    arch = get_arch(sc.arch)
    cfg = text_config_json(sc)
    if arch.synth_wrap is None:
        return SynthWrap(cfg)
    return arch.synth_wrap(sc, spec or _spec(sc), cfg)


def _layer_resident(sc: SynthConfig, spec: Spec, L: int) -> list[TensorName]:
    """One layer's non-expert tensors, in file order (the architecture's names and shapes)."""
    return get_arch(sc.arch).layer_tensors(spec, L, f"model.layers.{L}.{_moe_prefix(sc)}")


def _moe_prefix(sc: SynthConfig) -> str:
    # transformers>=5 writes the fused layout of every arch under `mlp` (Mixtral included).
    return get_arch(sc.arch).MOE_PREFIXES[0] if sc.layout == "per_expert" else "mlp"


@dataclass(frozen=True)
class SizeReport:
    """Parameter and byte counts of a SynthConfig (tensor data only; safetensors headers add a few KiB)."""

    params: int
    total_bytes: int
    expert_bytes: int
    expert_nbytes: int  # one expert of one layer
    table_bytes: int = 0  # per-layer n-gram tables (qwen4_exp), included in params and total_bytes

    @property
    def expert_share(self) -> float:
        return self.expert_bytes / self.total_bytes


def size_of(sc: SynthConfig) -> SizeReport:
    """Exact counts for `sc`, from the same tensor list `tensors` generates."""
    resident = 2 * sc.vocab_size * sc.hidden_size if not sc.tie_word_embeddings else sc.vocab_size * sc.hidden_size
    # More layers than sluice reads (MAX_LAYERS) are only ever sized to be refused as oversized (config_for_size's
    # "over twice the target"): size them as copies of the last layer rather than parse a config sluice refuses.
    n = min(sc.num_layers, MAX_LAYERS)
    spec = _spec(dataclasses.replace(sc, num_layers=n))
    resident += sum(math.prod(t.shape) for t in final_of(get_arch(sc.arch), spec))  # model.norm (or a final mixer)
    layers = [sum(math.prod(t.shape) for t in _layer_resident(sc, spec, L)) for L in range(n)]
    resident += sum(layers) + (sc.num_layers - n) * layers[-1]
    sparse = sum(spec.moe_layers) + (sc.num_layers - n) * spec.moe_layers[-1]
    experts = sparse * sc.num_experts * 3 * sc.hidden_size * sc.moe_intermediate_size
    wrap = _wrap(sc, spec)  # a vision tower, an mtp head (whose experts count as experts), n-gram tables
    resident += sum(math.prod(t.shape) for t in wrap.extra if not t.role.startswith(("experts", "table")))
    experts += sum(math.prod(t.shape) for t in wrap.extra if t.role.startswith("experts"))
    table = sum(math.prod(t.shape) for t in wrap.extra if t.role.startswith("table"))
    fixed = sum(t.numel() * t.element_size() for _, t in wrap.fixed)
    params = resident + experts + table
    expert_bytes = experts * sc.itemsize if get_arch(sc.arch).synth_experts is None else (
        sparse * sc.num_experts * sc.expert_nbytes)
    return SizeReport(params, (resident + table) * sc.itemsize + fixed + expert_bytes, expert_bytes,
                      sc.expert_nbytes, table * sc.itemsize)


# -- the size rule ---------------------------------------------------------------------------------------------------
_REF_PARAMS = 2**30  # 2 GiB of bf16: the size at which the rule gives 16 layers


def _hidden_for(params: float) -> int:
    """Hidden size by parameter count: small models get a small hidden so experts keep a sane intermediate size."""
    for limit, hidden in ((2**24, 128), (2**27, 256), (2**29, 512), (2**33, 1024)):
        if params < limit:
            return hidden
    return 2048


def config_for_size(arch: str, target_bytes: int, **overrides) -> SynthConfig:
    """A SynthConfig whose checkpoint is within ~5% of `target_bytes`, experts > 85% of it, like real MoEs.

    The rule, for P = target_bytes / dtype size parameters (each step skipped for a field given in `overrides`):
      1. experts, top_k: the family's (its module's SYNTH: 64 top-8 for qwen3_moe / olmoe / qwen2_moe, 8 top-2
         for mixtral, 128 top-8 for glm4_moe);
      2. hidden: 128 below 2^24 params, 256 below 2^27, 512 below 2^29, 1024 below 2^33, else 2048 (in bf16:
         below 32 MiB, 256 MiB, 1 GiB, 16 GiB); head_dim 64 (hidden <= 512) or 128; heads = hidden / head_dim;
         kv heads = heads / 4 (GQA, at least 1);
      3. vocab: embeddings + lm_head take ~4% of the bytes, rounded to a multiple of 1024 within [1024, 32768];
      4. layers = 16 * sqrt(P / 2^30), within [4, 48] (2 GiB of bf16 -> 16 layers, 6 GiB -> 28), so layers and
         the expert intermediate size both grow with the size;
      5. moe_intermediate_size: solved so the total hits the target (it is linear in it), rounded to the largest
         multiple of 64, 32, 16 or 8 that moves the total by at most 2%.
    Overrides: any SynthConfig field (e.g. num_layers=48, dtype="float32", layout="fused"); an unknown name is a
    ConfigError. With both num_layers and moe_intermediate_size given, the target cannot be honoured and is not.
    The n-gram tables (ple_bytes) come on top of the target: it sizes the rest of the model.
    Overrides that leave a checkpoint over twice the target are a ConfigError: without that check, --layers 10^9
    wrote until the disk was full and --hidden 10^9 failed allocating 2 TB.
    """
    if arch not in supported():
        raise ConfigError(f"arch: {arch!r} is not one of {', '.join(supported())}")
    known = {f.name for f in dataclasses.fields(SynthConfig)} - {"arch"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    info = get_arch(arch).SYNTH
    dtype = overrides.get("dtype", "bfloat16")
    if dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"dtype: {dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}")
    params = target_bytes / COMPUTE_DTYPES[dtype].itemsize

    H = overrides.get("hidden_size") or _hidden_for(params)
    head_dim = overrides.get("head_dim") or (64 if H <= 512 else 128)
    heads = overrides.get("num_heads") or max(1, H // head_dim)
    base = dict(
        arch=arch, hidden_size=H, head_dim=head_dim, num_heads=heads, num_kv_heads=max(1, heads // 4),
        num_experts=info.num_experts, top_k=info.top_k,
        vocab_size=min(32768, max(1024, round(0.04 * params / (2 * H) / 1024) * 1024)),
        num_layers=min(48, max(4, round(16 * math.sqrt(params / _REF_PARAMS)))),
        moe_intermediate_size=64,
    )
    base.update(overrides)
    sc = SynthConfig(**base)
    table = size_of(sc).table_bytes  # the same whatever the solved field
    if "moe_intermediate_size" not in overrides:
        sc = dataclasses.replace(sc, moe_intermediate_size=_solve(sc, target_bytes + table, "moe_intermediate_size"))
    elif "num_layers" not in overrides:
        sc = dataclasses.replace(sc, num_layers=_solve(sc, target_bytes + table, "num_layers"))
    total = size_of(sc).total_bytes - table
    if total > 2 * target_bytes:
        given = ", ".join(k for k in overrides if k in _SHAPE_FIELDS) or "none"
        raise ConfigError(f"the checkpoint would be {format_bytes(total)}, over twice the target size "
                          f"{format_bytes(target_bytes)} (shape overrides: {given}): give smaller overrides, or a "
                          "larger size")
    return sc


_SHAPE_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "num_experts", "top_k",
                 "moe_intermediate_size", "vocab_size")


def _solve(sc: SynthConfig, target: int, field: str) -> int:
    """The value of `field` (total bytes are linear in it) that brings the total nearest `target`, at least 1."""
    # sizes at two values the architecture accepts (gpt_oss: intermediate sizes in multiples of 32)
    least = 1 if field == "num_layers" else get_arch(sc.arch).SYNTH.intermediate_multiple
    b1 = size_of(dataclasses.replace(sc, **{field: least})).total_bytes
    b2 = size_of(dataclasses.replace(sc, **{field: 2 * least})).total_bytes
    exact = least * (1 + (target - b1) / (b2 - b1))
    if field == "num_layers":
        return max(1, round(exact))
    # Multiples of 64 keep quantization groups and kernels happy; settle for less when the rounding would cost.
    for granule in (64, 32, 16, 8, 1):
        if granule / 2 <= 0.02 * exact or granule <= least:
            granule = max(granule, least)
            return max(granule, round(exact / granule) * granule)
    raise AssertionError("unreachable")


# -- config files ----------------------------------------------------------------------------------------------------
def config_json(sc: SynthConfig, bos_token_id: int = 0, eos_token_id: int = 2) -> dict:
    """config.json as written: the text model's (text_config_json) in the wrapper the family ships it in, if any
    (the architecture's `synth_wrap`: qwen3_5_moe's nests it under text_config)."""
    arch = get_arch(sc.arch)
    cfg = text_config_json(sc, bos_token_id, eos_token_id)
    if arch.synth_wrap is None:
        return cfg
    spec = arch.ModelArgs.from_dict(cfg).spec()
    return arch.synth_wrap(sc, spec, cfg).config


def text_config_json(sc: SynthConfig, bos_token_id: int = 0, eos_token_id: int = 2) -> dict:
    """The text model's config.json as the architecture's transformers class reads it (hub spellings: rope_theta,
    torch_dtype).

    Token ids default to the trained tokenizer's: `<|endoftext|>` = 0 (bos/pad, as Qwen), `<|im_end|>` = 2 (eos).
    The architecture adds its own keys (its module's `synth_config`).
    """
    arch = get_arch(sc.arch)
    info = arch.SYNTH
    cfg: dict = {
        "architectures": [info.hf_class],
        "model_type": sc.arch,
        "vocab_size": sc.vocab_size,
        "hidden_size": sc.hidden_size,
        "num_hidden_layers": sc.num_layers,
        "num_attention_heads": sc.num_heads,
        "num_key_value_heads": sc.num_kv_heads,
        "head_dim": sc.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": info.rms_norm_eps,
        "rope_theta": info.rope_theta,
        "num_experts_per_tok": sc.top_k,
        "tie_word_embeddings": sc.tie_word_embeddings,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": bos_token_id,
        "initializer_range": sc.init_std,
        "attention_dropout": 0.0,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "use_cache": True,
        "torch_dtype": sc.dtype,  # transformers<5 and most tools
        "dtype": sc.dtype,  # transformers>=5
    }
    cfg.update(arch.synth_config(sc))
    return cfg


def generation_config_json(bos_token_id: int = 0, eos_token_id: int = 2) -> dict:
    """generation_config.json: the token ids only (greedy by default, like a base model)."""
    return {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": bos_token_id}


# -- tensors ---------------------------------------------------------------------------------------------------------
def tensors(sc: SynthConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, generated lazily in file order from one seeded generator.

    Order: embeddings, then layer by layer (attention, norms, router, [shared expert], experts expert by expert),
    final norm, lm_head, then what the family ships beside the model (synth_wrap: a vision tower, an mtp head). At
    most one layer's experts exist at once (fused layout); per-expert, one projection. Both layouts draw the same
    numbers in the same order, so they hold the same model. The text model's `model.*` names are under the
    wrapper's prefix (qwen3_5_moe: model.language_model.*).
    """
    wrap = _wrap(sc)
    for name, t in _text_tensors(sc):
        yield (wrap.prefix + name[len("model."):] if name.startswith("model.") else name), t
    g = _generator(sc, 1)
    yield from ((t.name, _draw(sc, g, t.shape, t.init)) for t in wrap.extra)
    yield from wrap.fixed


def _generator(sc: SynthConfig, stream: int = 0) -> torch.Generator:
    """Stream 0 draws the text model, stream 1 what is written beside it (so the text model's numbers do not
    depend on whether a wrapper is written)."""
    return torch.Generator().manual_seed(sc.seed + stream * 0x9E3779B9)


def _draw(sc: SynthConfig, g: torch.Generator, shape: tuple[int, ...], kind: str) -> torch.Tensor:
    dt = sc.torch_dtype
    if kind == "norm":  # ones plus small noise, so a norm that is skipped or misapplied shows in logits
        return (1.0 + torch.empty(shape).normal_(0.0, sc.init_std, generator=g)).to(dt)
    std = sc.embed_std if kind == "embed" else sc.init_std
    # Drawn directly in the target dtype: ~110M values/s, the dominant cost of make_model.
    return torch.empty(shape, dtype=dt).normal_(0.0, std, generator=g)


def _text_tensors(sc: SynthConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The text model's tensors under their text-only names (see `tensors`)."""
    g = _generator(sc)
    dt = sc.torch_dtype

    def draw(shape: tuple[int, ...], kind: str) -> torch.Tensor:
        return _draw(sc, g, shape, kind)

    H, I, E = sc.hidden_size, sc.moe_intermediate_size, sc.num_experts
    spec = _spec(sc)
    yield "model.embed_tokens.weight", draw((sc.vocab_size, H), "embed")
    for L in range(sc.num_layers):
        for t in _layer_resident(sc, spec, L):
            yield t.name, draw(t.shape, t.init)
        if not spec.moe_layers[L]:
            continue
        m = f"model.layers.{L}.{_moe_prefix(sc)}.experts"
        own = get_arch(sc.arch).synth_experts
        if own is not None:  # the architecture's own expert tensors (gpt_oss: MXFP4 blocks, scales, biases)
            yield from own(sc, draw, g, m)
        elif sc.layout == "per_expert":
            g_name, u_name, d_name = get_arch(sc.arch).EXPERT_PROJ
            for e in range(E):
                yield f"{m}.{e}.{g_name}.weight", draw((I, H), "proj")
                yield f"{m}.{e}.{u_name}.weight", draw((I, H), "proj")
                yield f"{m}.{e}.{d_name}.weight", draw((H, I), "proj")
        else:
            gate_up = torch.empty((E, 2 * I, H), dtype=dt)  # [E, 2I, H]: gate rows, then up rows
            down = torch.empty((E, H, I), dtype=dt)  # [E, H, I]
            for e in range(E):
                gate_up[e, :I] = draw((I, H), "proj")
                gate_up[e, I:] = draw((I, H), "proj")
                down[e] = draw((H, I), "proj")
            yield f"{m}.gate_up_proj", gate_up
            yield f"{m}.down_proj", down
            del gate_up, down
    for t in final_of(get_arch(sc.arch), spec):  # model.norm, or a final mixer
        yield t.name, draw(t.shape, t.init)
    if not sc.tie_word_embeddings:
        yield "lm_head.weight", draw((sc.vocab_size, H), "proj")


# -- writing ---------------------------------------------------------------------------------------------------------
def make_model(out: str | os.PathLike[str], sc: SynthConfig, progress: bool = True, force: bool = False) -> Path:
    """Write the synthetic checkpoint `sc` to folder `out`; return its path.

    Everything is written into `OUT.partial` and renamed to `OUT` at the end, so a crash never leaves a folder that
    looks like a model. An existing non-empty `out` is an OutputExistsError unless `force`, and even then only a
    model folder (one with config.json) is replaced. The tokenizer is trained with vocab_size = sc.vocab_size;
    config.json's vocab is at least the tokenizer's (it may be larger, as in real models).
    """
    from tokenizers import Tokenizer

    from ..checkpoint import write_sharded
    from .tokenizer_train import train_tokenizer

    out = Path(out)
    with writing_model(out, force) as partial:
        train_tokenizer(partial, vocab_size=sc.vocab_size, special_tokens=get_arch(sc.arch).SYNTH.special_tokens)
        tok = Tokenizer.from_file(str(partial / "tokenizer.json"))
        sc = dataclasses.replace(sc, vocab_size=max(sc.vocab_size, tok.get_vocab_size(with_added_tokens=True)))
        ids = {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>")}
        bos, eos = ids["<|endoftext|>"], ids["<|im_end|>"]
        _write_json(partial / "config.json", config_json(sc, bos, eos))
        _write_json(partial / "generation_config.json", generation_config_json(bos, eos))
        stream = tensors(sc)
        if progress:
            stream = _with_progress(stream, size_of(sc).total_bytes, out.name)
        write_sharded(partial, stream, sc.max_shard_bytes)
    return out


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _with_progress(
    stream: Iterator[tuple[str, torch.Tensor]], total: int, name: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Count bytes as tensors are generated: generation (~110M values/s) dominates writing, so this tracks the
    wall time well; the last shard is written after the bar reaches its total."""
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"writing {name}") as bar:
        for name_, t in stream:
            yield name_, t
            bar.update(t.numel() * t.element_size())


def describe(sc: SynthConfig) -> str:
    """One line of the shape, for summaries."""
    return (f"{sc.arch}: {sc.num_layers} layers, hidden {sc.hidden_size}, {sc.num_experts} experts (top-{sc.top_k}) "
            f"of intermediate {sc.moe_intermediate_size}, vocab {sc.vocab_size}, {sc.dtype}, {_layout_name(sc)}; "
            f"one expert {format_bytes(sc.expert_nbytes)}")


def _layout_name(sc: SynthConfig) -> str:
    own = get_arch(sc.arch).synth_experts is not None  # gpt_oss writes its experts as shipped (MXFP4)
    return "experts as the family ships them" if own else f"{sc.layout} layout"
