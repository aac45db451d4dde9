"""Which GGML type each tensor of a GGUF gets, as llama.cpp's own tools choose, and the bytes of that type.

A `sluice quantize --to TYPE` file is laid out as `convert_hf_to_gguf.py --outtype {f32,f16,bf16,q8_0,tq1_0,tq2_0}`
writes it, or, for the types it does not offer, as `llama-quantize` writes a Q4_0 / Q4_1 / Q5_0 / Q5_1 / MXFP4_MOE
file from that converter's bf16 output (src/llama-quant.cpp, `llama_tensor_get_type`; read to learn the rules,
nothing is copied):

- 1-D tensors, norms (`*_norm.weight`), biases, and the routers `ffn_gate_inp` stay F32 (both tools);
- every other tensor is stored in TYPE, except:
  - for the 4/5-bit types (llama-quantize's mix without --pure): `output.weight` (`token_embd.weight` when the
    embeddings are tied) -> Q6_K there; the `gguf` package cannot write K-quants, so sluice writes Q8_0, llama.cpp's
    own choice for it when a row is not whole 256-blocks; `attn_k` / `attn_v` of an 8-expert model (Mixtral) -> Q8_0;
  - for the ternary types (the converter's tq1_0 / tq2_0): `token_embd` and `output` -> F16;
  - for mxfp4 (llama-quantize's MXFP4_MOE): only the routed experts (`*_exps`) are MXFP4, every other 2-D weight
    (attention, shared experts, embeddings, output) Q8_0;
- a tensor whose rows are not whole blocks of its type (32 values for Q8_0 .. Q5_1 and MXFP4, 256 for TQ1_0 / TQ2_0)
  falls back to F16, as convert_hf_to_gguf.py does (llama-quantize would take Q4_0 for a ternary row, which the
  converter never writes); each fallback is reported by name.

Values are quantized from float32 by `gguf.quants.quantize` (the reference llama.cpp's tests compare with), so a
file's blocks are exactly what that function gives for the checkpoint's weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..checkpoint.ref import TensorRef

# --to name -> (GGML type name, general.file_type name of gguf.LlamaFileType); names as llama.cpp spells them
GGUF_TYPES = {
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
    "q4_1": ("Q4_1", "MOSTLY_Q4_1"),
    "q5_0": ("Q5_0", "MOSTLY_Q5_0"),
    "q5_1": ("Q5_1", "MOSTLY_Q5_1"),
    "tq1_0": ("TQ1_0", "MOSTLY_TQ1_0"),
    "tq2_0": ("TQ2_0", "MOSTLY_TQ2_0"),
    "mxfp4": ("MXFP4", "MOSTLY_MXFP4_MOE"),
}
_FLOAT = ("F32", "F16", "BF16")
_LLAMA_QUANTIZE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1")  # types only llama-quantize makes: its mix applies
_TERNARY = ("TQ1_0", "TQ2_0")  # the converter's: embeddings and output F16 ("TODO: use Q4_K and Q6_K" there)
# (ggml's ssm_conv reads F32; the shared expert gate [1, H] is one row, kept F32 by llama.cpp's quantizer too)
_ALWAYS_F32 = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


@dataclass(frozen=True)
class GgufTensor:
    """One GGUF tensor of an export (tools/gguf_export.py): its name, torch-order shape, and how to produce its data
    from the checkpoint."""

    name: str
    shape: tuple[int, ...]
    sources: tuple[TensorRef, ...]  # one tensor, or the E per-expert tensors stacked on dim 0
    rows: tuple[int, int] | None = None  # fused layout: the slice of dim 1 to keep (gate or up half)
    rope_heads: int | None = None  # llama q/k: rows permuted for interleaved rope, in this many heads
    # the source tensors as read (one argument each) -> the GGUF values (then shaped `shape`): what the converter
    # does to them (the hybrids' value maps, head reorders and splits: tools/gguf_hybrid.py; tools/gguf_layouts.py)
    transform: Callable[..., torch.Tensor] | None = None
    # a GGML type the transform gives the tensor's bytes in (uint8), written as they are whatever the file's type:
    # gpt-oss's MXFP4 experts, which the converter repacks and never converts
    raw_type: str | None = None


@dataclass(frozen=True)
class TypeChoice:
    """The GGML type of one tensor and, when it is not the requested one, why."""

    type: str  # GGML type name: "Q4_0", "F32", ...
    reason: str | None = None  # set when the tensor falls back (rows not whole blocks); None for the rule's type


def block_size(type_name: str) -> tuple[int, int]:
    """(values per block, bytes per block) of a GGML type."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]


def nbytes(type_name: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of torch-order `shape` stored as `type_name` (rows must be whole blocks)."""
    per, size = block_size(type_name)
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // per) * size


def choose(name: str, shape: tuple[int, ...], to: str, n_experts: int, tied: bool) -> TypeChoice:
    """The type llama.cpp's tools give GGUF tensor `name` (torch-order `shape`) in a `--to to` file of a model with
    `n_experts` experts per layer (`tied`: no output.weight, the embeddings serve as the output)."""
    want = GGUF_TYPES[to][0]
    if len(shape) < 2 or name.endswith(_ALWAYS_F32) or not name.endswith(".weight"):
        return TypeChoice("F32")
    if want in _FLOAT:
        return TypeChoice(want)
    if want in _LLAMA_QUANTIZE:
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            want = "Q8_0"  # llama-quantize: Q6_K (not writable by the gguf package); Q8_0 when rows aren't 256-blocks
        elif n_experts == 8 and name.endswith(("attn_k.weight", "attn_v.weight")):
            want = "Q8_0"
    elif want in _TERNARY and name in ("token_embd.weight", "output.weight"):
        return TypeChoice("F16")
    elif want == "MXFP4" and "_exps." not in name:
        want = "Q8_0"  # MXFP4_MOE: the routed experts MXFP4, everything else Q8_0
    per, _ = block_size(want)
    if shape[-1] % per:
        return TypeChoice("F16", f"rows of {shape[-1]} values are not whole {want} blocks of {per}")
    return TypeChoice(want)


def encode(values: np.ndarray, type_name: str) -> np.ndarray:
    """float32 `values` [..., n] as the bytes of `type_name` (an array whose .tobytes() is the GGUF data)."""
    import gguf
    from gguf.quants import quantize

    values = np.ascontiguousarray(values, dtype=np.float32)
    if type_name == "F32":
        return values
    if type_name == "F16":
        return values.astype(np.float16)
    return quantize(values, gguf.GGMLQuantizationType[type_name])
