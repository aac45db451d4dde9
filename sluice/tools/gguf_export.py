"""Export a Hugging Face qwen3_moe folder to GGUF, so llama.cpp runs the same weights with the same tokenizer.

Benchmarks compare sluice with llama.cpp on one checkpoint; this writes that checkpoint in llama.cpp's layout, as
its `convert_hf_to_gguf.py` lays out Qwen3-MoE (read to learn the mapping; nothing is copied):

    model.embed_tokens.weight                     token_embd.weight          [V, H]
    model.layers.N.input_layernorm.weight         blk.N.attn_norm.weight     [H]            always F32
    model.layers.N.self_attn.{q,k,v,o}_proj       blk.N.attn_{q,k,v,output}  no permutation: Qwen's rope is NeoX
    model.layers.N.self_attn.{q,k}_norm           blk.N.attn_{q,k}_norm      [head_dim]     always F32
    model.layers.N.post_attention_layernorm       blk.N.ffn_norm             [H]            always F32
    model.layers.N.mlp.gate.weight                blk.N.ffn_gate_inp         [E, H]         always F32 (exact routing)
    model.layers.N.mlp.experts.{e}.gate_proj      blk.N.ffn_gate_exps        [E, I, H]      experts stacked on dim 0
    model.layers.N.mlp.experts.{e}.up_proj        blk.N.ffn_up_exps          [E, I, H]
    model.layers.N.mlp.experts.{e}.down_proj      blk.N.ffn_down_exps        [E, H, I]
    model.norm.weight, lm_head.weight             output_norm, output

(shapes in torch order; GGUF stores dims reversed). The fused layout (`mlp.experts.gate_up_proj [E, 2I, H]` with
gate rows first, `mlp.experts.down_proj [E, H, I]`) maps to the same three stacks.

Streaming: the header (metadata and tensor infos) is built from config.json and the safetensors headers alone, then
tensors are read, converted and written one at a time, so peak memory is one layer's expert stack (E * I * H
elements of the output dtype, 64 MiB for the 3.4 GB benchmark model in bf16), never the model.

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
from ..checkpoint.ref import TensorRef
from ..errors import CheckpointError, ConfigError, SluiceError
from ..io.tensor import read_tensor
from ..models import model_args
from ..models.schema import show
from ..tokenizer import Tokenizer

EXPORT_DTYPES = ("f32", "bf16", "f16")
ARCH = "qwen3moe"  # llama.cpp's name for config.json model_type qwen3_moe

# A 2-D weight's bytes are stored in the chosen dtype; these stay F32 whatever it is, as llama.cpp expects (norms
# are applied with f32 ops) and because a bf16 -> f32 router is exact.
_ALWAYS_F32 = ("_norm.weight", "ffn_gate_inp.weight")

# The qwen2 pre-tokenizer split regex (Qwen2/Qwen3 tokenizer.json); llama.cpp calls it "qwen2".
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
                r"\s+(?!\S)|\s+")

# gguf's TokenType values (kept here so this module's constants do not need gguf at import time)
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


class ExportError(SluiceError):
    """The model cannot be written as a GGUF that llama.cpp runs identically (unsupported field or layout)."""


@dataclass(frozen=True)
class GgufTensor:
    """One GGUF tensor: its name, torch-order shape, and how to produce its data from the checkpoint."""

    name: str
    shape: tuple[int, ...]
    sources: tuple[TensorRef, ...]  # one tensor, or the E per-expert tensors stacked on dim 0
    rows: tuple[int, int] | None = None  # fused layout: the slice of dim 1 to keep (gate or up half)

    @property
    def always_f32(self) -> bool:
        return len(self.shape) == 1 or self.name.endswith(_ALWAYS_F32)


# -- the pure part: names and shapes ---------------------------------------------------------------------------------
def export_args(index: CheckpointIndex):
    """The validated qwen3_moe ModelArgs of `index` (ConfigError names a bad field); ExportError for a config
    whose math llama.cpp's qwen3moe graph does not compute."""
    model_type = index.config.get("model_type")
    if model_type != "qwen3_moe":
        raise ExportError(f"config.json model_type {show(model_type)}: export-gguf supports qwen3_moe only")
    _, args = model_args(index.config, index.folder / CONFIG)
    if not args.norm_topk_prob:  # absent means false, in transformers as in sluice
        raise ExportError("config.json norm_topk_prob is false or absent; llama.cpp's qwen3moe always renormalizes "
                          "the top-k")
    if not all(args.moe_layers()):
        raise ExportError("config.json mlp_only_layers / decoder_sparse_step: dense layers are not supported")
    if args.rope.rope_type != "default" or args.rope.partial_rotary_factor != 1:
        raise ExportError(f"config.json rope type {args.rope.rope_type!r} (partial_rotary_factor "
                          f"{args.rope.partial_rotary_factor}): only plain full rope is supported")
    if args.attention_bias:
        raise ExportError("config.json attention_bias is true: qwen3_moe in llama.cpp has no q/k/v biases")
    if args.use_sliding_window and args.sliding_window:
        raise ExportError("config.json use_sliding_window is true: llama.cpp's qwen3moe attends to the whole context")
    return args


def tensor_plan(index: CheckpointIndex) -> list[GgufTensor]:
    """Every GGUF tensor in file order, mapped from the checkpoint's names (nothing is read)."""
    args = export_args(index)
    L, E = args.num_hidden_layers, args.num_experts
    out: list[GgufTensor] = []

    def one(gguf_name: str, hf_name: str) -> None:
        ref = index[hf_name]
        out.append(GgufTensor(gguf_name, tuple(ref.shape), (ref,)))

    one("token_embd.weight", "model.embed_tokens.weight")
    for n in range(L):
        p, g = f"model.layers.{n}", f"blk.{n}"
        one(f"{g}.attn_norm.weight", f"{p}.input_layernorm.weight")
        for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output"),
                       ("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):
            one(f"{g}.{gg}.weight", f"{p}.self_attn.{hf}.weight")
        one(f"{g}.ffn_norm.weight", f"{p}.post_attention_layernorm.weight")
        one(f"{g}.ffn_gate_inp.weight", f"{p}.mlp.gate.weight")
        out += _expert_stacks(index, p, g, E)
    one("output_norm.weight", "model.norm.weight")
    head = "lm_head.weight" if "lm_head.weight" in index else "model.embed_tokens.weight"  # tied: reuse
    one("output.weight", head)
    return out


def _expert_stacks(index: CheckpointIndex, p: str, g: str, n_experts: int) -> list[GgufTensor]:
    fused = f"{p}.mlp.experts.gate_up_proj"
    if fused in index:
        gu, down = index[fused], index[f"{p}.mlp.experts.down_proj"]
        E, two_i, H = gu.shape
        if E != n_experts or two_i % 2:
            raise CheckpointError(f"expected [{n_experts}, 2*I, H], got {list(gu.shape)}", file=gu.path, tensor=fused)
        i = two_i // 2
        return [GgufTensor(f"{g}.ffn_gate_exps.weight", (E, i, H), (gu,), rows=(0, i)),
                GgufTensor(f"{g}.ffn_up_exps.weight", (E, i, H), (gu,), rows=(i, two_i)),
                GgufTensor(f"{g}.ffn_down_exps.weight", tuple(down.shape), (down,))]
    stacks = []
    for hf, gg in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
        refs = tuple(index[f"{p}.mlp.experts.{e}.{hf}.weight"] for e in range(n_experts))
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
def _convert(t: torch.Tensor, dtype: str) -> np.ndarray:
    """A torch tensor as the numpy array whose bytes are the GGUF data (bf16 as its raw 16-bit patterns)."""
    if dtype == "f32":
        return t.to(torch.float32).numpy()
    if dtype == "f16":
        return t.to(torch.float16).numpy()
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _data(gt: GgufTensor) -> torch.Tensor:
    """The tensor's values in the source dtype (read now; one layer's expert stack at most)."""
    if gt.rows is not None:
        lo, hi = gt.rows
        return read_tensor(gt.sources[0])[:, lo:hi]
    if len(gt.sources) == 1:
        return read_tensor(gt.sources[0])
    first = gt.sources[0]
    out = torch.empty(gt.shape, dtype=first.torch_dtype)  # [E, out, in]
    for e, ref in enumerate(gt.sources):
        out[e] = read_tensor(ref)
    return out


def export_gguf(model: str | os.PathLike[str], out: str | os.PathLike[str], dtype: str = "bf16",
                progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Write `model` (a qwen3_moe Hugging Face folder) as the GGUF file `out`, 2-D weights in `dtype`.

    Written to `OUT.partial` and renamed at the end. `progress(nbytes)` is called after each tensor with the bytes
    just written. Returns a summary: path, tensors, bytes, dtype, tokenizer pre-type, vocab size.
    """
    import gguf  # optional extra: pip install 'sluice[gguf]'

    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"dtype: {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    folder, out = Path(model), Path(out)
    index = CheckpointIndex.open(folder)
    plan = tensor_plan(index)
    vocab = vocab_meta(folder, index.config)
    args = export_args(index)
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16}[dtype]

    partial = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(partial, ARCH)  # writes general.architecture
    w.add_name(folder.name)
    w.add_file_type(ftype)
    w.add_block_count(args.num_hidden_layers)
    w.add_context_length(args.max_position_embeddings)
    w.add_embedding_length(args.hidden_size)
    if "intermediate_size" in index.config:
        w.add_feed_forward_length(args.intermediate_size)
    w.add_head_count(args.num_attention_heads)
    w.add_head_count_kv(args.num_key_value_heads)
    w.add_key_length(args.head_dim)
    w.add_value_length(args.head_dim)
    w.add_rope_freq_base(args.rope.theta)
    w.add_layer_norm_rms_eps(args.rms_norm_eps)
    w.add_expert_count(args.num_experts)
    w.add_expert_used_count(args.num_experts_per_tok)
    w.add_expert_feed_forward_length(args.moe_intermediate_size)

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

    out_types = []
    for gt in plan:
        t_dtype = "f32" if gt.always_f32 else dtype
        itemsize = 4 if t_dtype == "f32" else 2
        np_dtype = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[t_dtype]
        raw = None if t_dtype != "bf16" else gguf.GGMLQuantizationType.BF16
        nbytes = itemsize * int(np.prod(gt.shape))
        w.add_tensor_info(gt.name, gt.shape, np.dtype(np_dtype), nbytes, raw_dtype=raw)
        out_types.append(t_dtype)

    total = 0
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for gt, t_dtype in zip(plan, out_types):
            arr = np.ascontiguousarray(_convert(_data(gt), t_dtype))
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
    return {"path": str(out), "tensors": len(plan), "bytes": out.stat().st_size, "tensor_bytes": total,
            "dtype": dtype, "tokenizer_pre": vocab.pre, "vocab": len(vocab.tokens)}


def planned_bytes(model: str | os.PathLike[str], dtype: str = "bf16") -> int:
    """Tensor bytes the GGUF of `model` will hold in `dtype` (for a progress bar)."""
    total = 0
    for gt in tensor_plan(CheckpointIndex.open(model)):
        total += (4 if gt.always_f32 or dtype == "f32" else 2) * int(np.prod(gt.shape))
    return total

