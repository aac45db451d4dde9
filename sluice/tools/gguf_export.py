"""Export a Hugging Face MoE folder to GGUF, so llama.cpp runs the same weights with the same tokenizer.

Benchmarks compare sluice with llama.cpp on one checkpoint, and `sluice quantize` makes GGUF files of any type; this
writes the checkpoint in llama.cpp's layout, as its `convert_hf_to_gguf.py` lays out each architecture (read to
learn the mapping; nothing is copied). config.json model_type -> GGUF architecture: qwen3_moe -> qwen3moe,
qwen2_moe -> qwen2moe, olmoe -> olmoe, mixtral -> llama (with experts), the Gated DeltaNet hybrids qwen3_next ->
qwen3next, qwen3_5_moe (either layout) -> qwen35moe, whose tensors and keys tools/gguf_hybrid.py lays out, and
gpt_oss -> gpt-oss, glm4_moe -> glm4moe, deepseek_v3 -> deepseek2, which tools/gguf_layouts.py lays out.

    model.embed_tokens.weight                     token_embd.weight          [V, H]
    model.layers.N.input_layernorm.weight         blk.N.attn_norm.weight     [H]            always F32
    model.layers.N.self_attn.{q,k,v,o}_proj       blk.N.attn_{q,k,v,output}  llama (Mixtral): q/k rows permuted for
                                                                             llama.cpp's interleaved rope; the Qwen
                                                                             and OLMoE ropes are NeoX: unpermuted
    model.layers.N.self_attn.{q,k,v}_proj.bias    blk.N.attn_{q,k,v}.bias    qwen2moe; always F32
    model.layers.N.self_attn.{q,k}_norm           blk.N.attn_{q,k}_norm      qwen3moe [head_dim], olmoe [H]; F32
    model.layers.N.post_attention_layernorm       blk.N.ffn_norm             [H]            always F32
    model.layers.N.{mlp,block_sparse_moe}.gate    blk.N.ffn_gate_inp         [E, H]         always F32 (exact routing)
    ....experts.{e}.gate_proj (Mixtral: w1)       blk.N.ffn_gate_exps        [E, I, H]      experts stacked on dim 0
    ....experts.{e}.up_proj (w3)                  blk.N.ffn_up_exps          [E, I, H]
    ....experts.{e}.down_proj (w2)                blk.N.ffn_down_exps        [E, H, I]
    model.layers.N.mlp.shared_expert.*_proj       blk.N.ffn_{gate,up,down}_shexp   qwen2moe
    model.layers.N.mlp.shared_expert_gate         blk.N.ffn_gate_inp_shexp   [H] (squeezed from [1, H]), F32
    model.norm.weight, lm_head.weight             output_norm, output        no output.weight when tied

(shapes in torch order; GGUF stores dims reversed). The fused layout (`mlp.experts.gate_up_proj [E, 2I, H]` with
gate rows first, `mlp.experts.down_proj [E, H, I]`) maps to the same three stacks. Which GGML type each tensor gets
is tools/gguf_types.py's rule (llama.cpp's tools' choices).

Streaming: the header (metadata and tensor infos) is built from config.json and the safetensors headers alone, then
tensors are read, converted and written one at a time, so peak memory is one layer's expert stack in the
checkpoint's dtype (E * I * H values: 403 MB in bf16 for Qwen3-30B-A3B's 128 x 768 x 2048) plus one expert in
float32 while quantizing, never the model.

Tokenizer: the byte-level BPE of tokenizer.json as llama.cpp's "gpt2" tokenizer model (tokens, types, merges), the
pre-tokenizer named by what tokenizer.json declares, the special token ids, add-bos, and the chat template.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checkpoint.index import CONFIG, CheckpointIndex
from ..checkpoint.paths import output_kind
from ..errors import CheckpointError, ConfigError, SluiceError
from ..quant.tensor import read_tensor
from ..models import archs, model_args
from ..models.schema import show
from ..store.layout import moe_prefix
from ..tokenizer import Tokenizer
from .gguf_hybrid import HYBRID_ARCHS, hybrid_hparams, hybrid_problem, hybrid_tensors
from .gguf_layouts import LAYOUT_ARCHS, layout_hparams, layout_problem, layout_tensors
from .gguf_types import GGUF_TYPES, GgufTensor, TypeChoice, choose, encode, nbytes
from ..plan import open_index

EXPORT_DTYPES = tuple(GGUF_TYPES)  # "f32", "f16", "bf16", "q8_0", "q4_0" .. "q5_1", "tq1_0", "tq2_0", "mxfp4"
#: architectures sluice reads from GGUF and does not write (export_args says to use llama.cpp's converter)
CONVERTER_ONLY = ("qwen4_exp",)


#: config.json model_type -> llama.cpp's GGUF architecture name
def gguf_archs() -> dict[str, Any]:
    """model_type -> its GGUFArch (models/<model_type>.py GGUF), for the architectures llama.cpp runs."""
    return {t: m.GGUF for t, m in archs().items() if m.GGUF is not None}

# The qwen2 pre-tokenizer split regex (Qwen2/Qwen3 tokenizer.json); llama.cpp calls it "qwen2".
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
                r"\s+(?!\S)|\s+")

# gguf's TokenType values (kept here so this module's constants do not need gguf at import time)
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


class ExportError(SluiceError):
    """The model cannot be written as a GGUF that llama.cpp runs identically (unsupported field or layout)."""


@dataclass(frozen=True)
class ExportPlan:
    """What a GGUF of one checkpoint holds: the architecture, its validated args, and every tensor in file order."""

    arch: str  # GGUF architecture name
    args: Any  # the model file's ModelArgs
    tensors: list[GgufTensor]

    @property
    def tied(self) -> bool:
        return all(t.name != "output.weight" for t in self.tensors)

    def types(self, to: str) -> list[TypeChoice]:
        """The GGML type of each tensor in a `--to to` file (tools/gguf_types.py; bytes given in a type: that one)."""
        E = self.args.num_experts
        return [TypeChoice(t.raw_type) if t.raw_type else choose(t.name, t.shape, to, E, self.tied)
                for t in self.tensors]


# -- the pure part: names and shapes ---------------------------------------------------------------------------------
def export_args(index: CheckpointIndex):
    """The validated ModelArgs of `index` (ConfigError names a bad field); ExportError for a config whose math
    llama.cpp's graph for the architecture does not compute."""
    model_type = index.config.get("model_type")
    known = gguf_archs()
    if model_type not in known:
        raise ExportError(f"{index.folder / CONFIG}: model_type {show(model_type)} is not supported; GGUF export "
                          f"supports {', '.join(t for t in known if t not in CONVERTER_ONLY)}")
    _, args = model_args(index.config, index.folder / CONFIG)
    spec, gg = args.spec(), known[model_type]
    arch, norm = gg.name, gg.norm_topk_prob
    if spec.hc_count > 1 or spec.qsa is not None or spec.ple is not None:  # qwen4_exp: llama.cpp's converter does
        raise ExportError(f"{index.folder / CONFIG}: model_type {model_type}: sluice's GGUF export writes no "
                          "hyper-connections, QSA indexer or n-gram tables; convert the folder with llama.cpp's "
                          "convert_hf_to_gguf.py (sluice reads its file)")
    if arch in LAYOUT_ARCHS:  # their own rules: tools/gguf_layouts.py
        if why := layout_problem(arch, spec, args):
            raise ExportError(why)
        return args
    if spec.norm_topk_prob != norm:  # absent means false, in transformers as in sluice
        raise ExportError(f"config.json norm_topk_prob is {str(spec.norm_topk_prob).lower()} (or absent); llama.cpp's "
                          f"{arch} graph always computes it as {str(norm).lower()}")
    if not all(spec.moe_layers):
        raise ExportError("config.json mlp_only_layers / decoder_sparse_step: dense layers are not supported")
    rope = spec.rope
    if rope.rope_type != "default" or (rope.partial_rotary_factor != 1 and not gg.partial_rope):
        raise ExportError(f"config.json rope type {rope.rope_type!r} (partial_rotary_factor "
                          f"{rope.partial_rotary_factor}): only plain full rope is supported")
    if spec.delta is not None and (why := hybrid_problem(spec)):
        raise ExportError(why)
    if (spec.qkv_bias and arch != "qwen2moe") or spec.o_bias:
        raise ExportError(f"config.json attention_bias is true: {arch} in llama.cpp has no attention biases")
    if any(w is not None for w in spec.sliding_window):
        raise ExportError("config.json sliding window is on: llama.cpp's graph attends to the whole context; set "
                          "sliding_window to null (or use_sliding_window false) if the model was trained without it")
    if spec.clip_qkv is not None:
        raise ExportError("config.json clip_qkv is set: llama.cpp's olmoe graph does not clamp q/k/v")
    return args


def export_plan(index: CheckpointIndex) -> ExportPlan:
    """Every GGUF tensor in file order, mapped from the checkpoint's names (nothing is read)."""
    args = export_args(index)
    facts = gguf_archs()[index.config["model_type"]]
    arch = facts.name
    spec = args.spec()
    module = _arch_module(index)
    stacks = lambda moe, g: _expert_stacks(index, moe, g, args.num_experts, module.EXPERT_PROJ)  # noqa: E731
    if spec.delta is not None:  # the Gated DeltaNet hybrids: tools/gguf_hybrid.py
        return ExportPlan(arch, args, hybrid_tensors(index, spec, facts, module, stacks))
    if arch in LAYOUT_ARCHS:  # gpt-oss, glm4moe, deepseek2: tools/gguf_layouts.py
        return ExportPlan(arch, args, layout_tensors(index, spec, facts, module, stacks))
    out: list[GgufTensor] = []

    def one(gguf_name: str, hf_name: str, rope_heads: int | None = None, squeeze: bool = False) -> None:
        ref = index[hf_name]
        shape = tuple(d for d in ref.shape if d != 1) if squeeze else tuple(ref.shape)
        out.append(GgufTensor(gguf_name, shape, (ref,), rope_heads=rope_heads))

    one("token_embd.weight", "model.embed_tokens.weight")
    for n in range(args.num_hidden_layers):
        p, g = f"model.layers.{n}", f"blk.{n}"
        one(f"{g}.attn_norm.weight", f"{p}.input_layernorm.weight")
        for hf, gg in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
            heads = {"q": spec.n_heads, "k": spec.n_kv_heads}.get(hf) if arch == "llama" else None
            one(f"{g}.{gg}.weight", f"{p}.self_attn.{hf}_proj.weight", rope_heads=heads)
            if spec.qkv_bias and hf != "o":
                one(f"{g}.{gg}.bias", f"{p}.self_attn.{hf}_proj.bias")
        if spec.qk_norm != "none":
            one(f"{g}.attn_q_norm.weight", f"{p}.self_attn.q_norm.weight")
            one(f"{g}.attn_k_norm.weight", f"{p}.self_attn.k_norm.weight")
        one(f"{g}.ffn_norm.weight", f"{p}.post_attention_layernorm.weight")
        moe = moe_prefix(index, _arch_module(index), n)
        one(f"{g}.ffn_gate_inp.weight", f"{moe}.gate.weight")
        out += _expert_stacks(index, moe, g, args.num_experts, _arch_module(index).EXPERT_PROJ)
        if spec.shared_expert_intermediate_size:
            one(f"{g}.ffn_gate_inp_shexp.weight", f"{p}.mlp.shared_expert_gate.weight", squeeze=True)
            for proj in ("gate", "up", "down"):
                one(f"{g}.ffn_{proj}_shexp.weight", f"{p}.mlp.shared_expert.{proj}_proj.weight")
    one("output_norm.weight", "model.norm.weight")
    if "lm_head.weight" in index and not spec.tie_word_embeddings:  # tied: llama.cpp reuses token_embd
        one("output.weight", "lm_head.weight")
    return ExportPlan(arch, args, out)


def tensor_plan(index: CheckpointIndex) -> list[GgufTensor]:
    """Every GGUF tensor in file order (export_plan's tensors)."""
    return export_plan(index).tensors


def _arch_module(index: CheckpointIndex):
    from ..models import get_arch

    return get_arch(index.config["model_type"])


def _expert_stacks(index: CheckpointIndex, p: str, g: str, n_experts: int,
                   names: tuple[str, str, str]) -> list[GgufTensor]:
    fused = f"{p}.experts.gate_up_proj"
    if fused in index:
        gu, down = index[fused], index[f"{p}.experts.down_proj"]
        E, two_i, H = gu.shape
        if E != n_experts or two_i % 2:
            raise CheckpointError(f"expected [{n_experts}, 2*I, H], got {list(gu.shape)}", file=gu.path, tensor=fused)
        i = two_i // 2
        return [GgufTensor(f"{g}.ffn_gate_exps.weight", (E, i, H), (gu,), rows=(0, i)),
                GgufTensor(f"{g}.ffn_up_exps.weight", (E, i, H), (gu,), rows=(i, two_i)),
                GgufTensor(f"{g}.ffn_down_exps.weight", tuple(down.shape), (down,))]
    stacks = []
    for hf, gg in zip(names, ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
        refs = tuple(index[f"{p}.experts.{e}.{hf}.weight"] for e in range(n_experts))
        shapes = {r.shape for r in refs}
        if len(shapes) != 1:
            raise CheckpointError(f"experts of {p} {hf} differ in shape: {sorted(shapes)}", tensor=refs[0].name)
        stacks.append(GgufTensor(f"{g}.{gg}.weight", (n_experts, *refs[0].shape), refs))
    return stacks


# -- tokenizer metadata ----------------------------------------------------------------------------------------------
@dataclass
class VocabMeta:
    """What llama.cpp's gpt2-style BPE tokenizer needs, read from the folder's tokenizer files."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    add_bos: bool
    chat_template: str | None


def pre_tokenizer_name(pre: dict | None) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for tokenizer.json's pre_tokenizer: "gpt-2" for plain ByteLevel with its
    built-in regex, "qwen2" for Qwen's Split + ByteLevel. Anything else is an ExportError: llama.cpp would split
    text differently and prompts would encode to other ids."""
    if pre and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    if pre and pre.get("type") == "Sequence":
        parts = pre.get("pretokenizers", [])
        if (len(parts) == 2 and parts[0].get("type") == "Split"
                and parts[0].get("pattern", {}).get("Regex") == _QWEN2_SPLIT
                and parts[1].get("type") == "ByteLevel" and not parts[1].get("use_regex", True)):
            return "qwen2"
    raise ExportError(f"tokenizer.json pre_tokenizer {json.dumps(pre)[:200]}: no llama.cpp equivalent is known")


def vocab_meta(folder: Path, config: dict) -> VocabMeta:
    """Tokens padded to config.json's vocab_size (ids the tokenizer lacks become `[PAD<id>]`, user-defined, as
    the hub converter does), token types (control for special added tokens), merges, and special ids."""
    tok = Tokenizer.from_folder(folder)
    data = json.loads((folder / "tokenizer.json").read_text("utf-8"))
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise ExportError(f"tokenizer.json model type {model.get('type')!r}: only byte-level BPE is supported")
    pre = pre_tokenizer_name(data.get("pre_tokenizer"))
    n_vocab = max(config["vocab_size"], tok.vocab_size)  # validated by tensor_plan (export_args) first
    by_id = {i: t for t, i in tok.backend.get_vocab(with_added_tokens=True).items()}
    added = tok.backend.get_added_tokens_decoder()  # {id: AddedToken}
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(_USER_DEFINED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(_CONTROL if added[i].special else _USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(_NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    def special(name: str, config_key: str) -> int | None:
        tid = tok._special_id(name)
        value = config.get(config_key) if tid is None else tid
        return value if isinstance(value, int) else None  # eos_token_id may be a list: then the tokenizer's

    template = tok.chat_template
    if isinstance(template, dict):  # named templates: llama.cpp reads the default one
        template = template.get("default") or next(iter(template.values()), None)
    return VocabMeta(tokens, types, merges, pre, special("bos_token", "bos_token_id"),
                     special("eos_token", "eos_token_id"), special("pad_token", "pad_token_id"),
                     tok.add_bos_token, template)


# -- writing ---------------------------------------------------------------------------------------------------------
def _data(gt: GgufTensor) -> torch.Tensor:
    """The tensor's values in the source dtype, in GGUF row order (read now; one layer's expert stack at most)."""
    if gt.rows is not None:
        lo, hi = gt.rows
        return read_tensor(gt.sources[0])[:, lo:hi]
    if gt.transform is not None:  # it works on the tensors as read, and gives the GGUF tensor's values (or bytes)
        t = gt.transform(*(read_tensor(ref) for ref in gt.sources))
        return t if gt.raw_type else t.reshape(gt.shape)
    if len(gt.sources) == 1:
        t = read_tensor(gt.sources[0]).reshape(gt.shape)
        if gt.rope_heads is not None:  # convert_hf_to_gguf's LlamaModel.permute: [heads, 2, D/2, H] -> [heads, D/2, 2, H]
            n = gt.rope_heads
            t = t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        return t
    first = gt.sources[0]
    # [E, out, in]; quantized experts (an FP8 folder's) in the float32 read_tensor dequantizes them to
    out = torch.empty(gt.shape, dtype=torch.float32 if first.quantized else first.torch_dtype)
    for e, ref in enumerate(gt.sources):
        out[e] = read_tensor(ref)
    return out


def _bytes_of(t: torch.Tensor, type_name: str) -> np.ndarray:
    """The GGUF data of `t` stored as `type_name`: bf16 as its raw 16-bit patterns (exact from a bf16 checkpoint, and
    torch's round-to-nearest-even as gguf's BF16 encoder), other types through tools/gguf_types.encode."""
    if t.dtype == torch.uint8:  # bytes already in their type (GgufTensor.raw_type)
        return t.contiguous().numpy()
    if type_name == "BF16":
        return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    if t.dim() == 3:  # an expert stack: one expert in float32 at a time (gguf's encoder makes a few copies of it)
        return np.stack([encode(t[e].to(torch.float32).numpy(), type_name) for e in range(t.shape[0])])
    return encode(t.to(torch.float32).numpy(), type_name)


def check_output(out: Path, force: bool) -> None:
    """OUT may be written: it does not exist, or `force` is given and it is a regular file (or a symbolic link to one,
    which the output then replaces, leaving its target alone). A folder, a FIFO, a device, a socket or a link that
    loops or leads nowhere is refused even with `force`: rename would put a regular file in its place (as root, over
    /dev/...). OUT.partial, the name written, may only be a regular file left by an earlier run: it is opened for
    writing, which a FIFO would block and a symbolic link would redirect."""
    from .output import OutputExistsError

    kind = output_kind(out)
    if kind == "directory":
        raise OutputExistsError(f"{out} is a directory; choose a file name for the GGUF")
    if kind not in ("missing", "file"):
        raise OutputExistsError(f"{out} is {kind}, not a file sluice may replace; choose another OUT")
    if kind == "file" and not force:
        raise OutputExistsError(f"{out} exists; pass --force to replace it")
    partial = out.with_name(out.name + ".partial")
    if os.path.islink(partial) or output_kind(partial) not in ("missing", "file"):
        raise OutputExistsError(f"{partial} exists and is not a file an earlier run left: move it away")


def export_gguf(model: str | os.PathLike[str], out: str | os.PathLike[str], dtype: str = "bf16",
                progress: Callable[[int], None] | None = None, force: bool = False,
                fallbacks: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """Write `model` (a supported Hugging Face MoE folder) as the GGUF file `out`, 2-D weights in `dtype` (one of
    EXPORT_DTYPES; see tools/gguf_types.py for the tensors kept in F32 or another type).

    Written to `OUT.partial` and renamed at the end (removed on any error); an existing OUT is replaced only with
    `force`. `progress(nbytes)` is called after each tensor with the bytes just written. Tensors that fall back to
    another type are appended to `fallbacks` as (name, reason). Returns a summary: path, tensors, bytes, dtype,
    tokenizer pre-type, vocab size, fallbacks.
    """
    import gguf  # optional extra: pip install 'sluice[gguf]'

    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"dtype: {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    folder, out = Path(model), Path(out)
    check_output(out, force)
    index = open_index(folder)
    plan = export_plan(index)
    vocab = vocab_meta(folder, index.config)
    types = plan.types(dtype)
    fell = [(t.name, c.reason) for t, c in zip(plan.tensors, types) if c.reason]
    if fallbacks is not None:
        fallbacks += fell

    partial = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(partial, plan.arch)  # writes general.architecture
    w.add_name(folder.name)
    w.add_file_type(gguf.LlamaFileType[GGUF_TYPES[dtype][1]])
    if GGUF_TYPES[dtype][0] not in ("F32", "F16", "BF16"):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _hparams(w, plan, index.config)
    _tokenizer_keys(w, vocab)
    for gt, choice in zip(plan.tensors, types):
        w.add_tensor_info(gt.name, gt.shape, np.dtype(np.float32), nbytes(choice.type, gt.shape),
                          raw_dtype=gguf.GGMLQuantizationType[choice.type])

    total = 0
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for gt, choice in zip(plan.tensors, types):
            arr = np.ascontiguousarray(_bytes_of(_data(gt), choice.type))
            w.write_tensor_data(arr)
            total += arr.nbytes
            if progress is not None:
                progress(arr.nbytes)
            del arr
        w.close()
        os.replace(partial, out)
    except BaseException:
        w.close()
        partial.unlink(missing_ok=True)
        raise
    return {"path": str(out), "tensors": len(plan.tensors), "bytes": out.stat().st_size, "tensor_bytes": total,
            "dtype": dtype, "arch": plan.arch, "tokenizer_pre": vocab.pre, "vocab": len(vocab.tokens),
            "fallbacks": [f"{n}: {why}, F16" for n, why in fell]}


def _hparams(w, plan: ExportPlan, config: dict) -> None:
    """The `{arch}.*` keys convert_hf_to_gguf.py writes for the architecture (what checkpoint/gguf_config.py reads)."""
    args, spec = plan.args, plan.args.spec()
    if plan.arch in LAYOUT_ARCHS:
        layout_hparams(w, plan.arch, spec, config)
        return
    w.add_block_count(args.num_hidden_layers)
    w.add_context_length(args.max_position_embeddings)
    w.add_embedding_length(args.hidden_size)
    w.add_head_count(args.num_attention_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_freq_base(spec.rope.theta)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_expert_count(spec.num_experts)
    w.add_expert_used_count(spec.top_k)
    if plan.arch in ("qwen3moe", "qwen2moe"):
        if config.get("intermediate_size"):
            w.add_feed_forward_length(config["intermediate_size"])
        w.add_expert_feed_forward_length(spec.moe_intermediate_size)
        if spec.shared_expert_intermediate_size:
            w.add_expert_shared_feed_forward_length(spec.shared_expert_intermediate_size)
    elif plan.arch in HYBRID_ARCHS:
        hybrid_hparams(w, plan.arch, spec, config)
    else:  # olmoe, llama: feed_forward_length is the experts' size
        w.add_feed_forward_length(spec.moe_intermediate_size)
    if plan.arch == "llama":
        w.add_rope_dimension_count(spec.head_dim)
        w.add_vocab_size(spec.vocab_size)


def _tokenizer_keys(w, vocab: VocabMeta) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    for adder, value in ((w.add_bos_token_id, vocab.bos_id), (w.add_eos_token_id, vocab.eos_id),
                         (w.add_pad_token_id, vocab.pad_id)):
        if value is not None:
            adder(value)
    w.add_add_bos_token(vocab.add_bos)
    if vocab.chat_template:
        w.add_chat_template(vocab.chat_template)


def planned_bytes(model: str | os.PathLike[str], dtype: str = "bf16") -> int:
    """Tensor bytes the GGUF of `model` will hold in `dtype` (for a progress bar)."""
    plan = export_plan(open_index(model))
    return sum(nbytes(c.type, t.shape) for t, c in zip(plan.tensors, plan.types(dtype)))
