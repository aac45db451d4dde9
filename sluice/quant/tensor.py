"""read_tensor: one whole tensor read (io/tensor.py read_bytes) and turned into a torch tensor: plain dtypes as
stored, block formats, MLX affine and FP8 block-scaled weights dequantized (bitwise the gguf / mx.dequantize /
transformers reference in float32). read_stored: a projection's stored bytes laid out as its QuantSpec's parts."""

from __future__ import annotations

import torch

from ..checkpoint.ref import TensorRef, unstored
from ..errors import CheckpointError
from ..io.tensor import read_bytes
from . import ggml
from .fp8 import dequantize_fp8
from .mlx import dequantize_mlx
from .spec import QuantSpec


def read_tensor(ref: TensorRef, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Read `ref`'s bytes into a fresh tensor of `ref.torch_dtype` and `ref.shape` (scalars and empty tensors too).

    A tensor in a block format (GGUF Q4_K, ...) or an MLX affine weight (`ref.mlx`: its codes, scales and biases
    are read) or an FP8 weight (`ref.fp8`: its codes and block scales are read) comes back dequantized, in `dtype` (bitwise the gguf / mx.dequantize reference in float32; another
    dtype is that value rounded once). Rows a GGUF converter permuted for llama.cpp's rope
    (`ref.rope_heads`) come back in Hugging Face order, values a converter mapped (`ref.values`: a norm stored as
    1 + w, ...) as the Hugging Face values. Raises CheckpointError (naming the file and tensor) when the
    file is missing, short, not the version its header was read from (`ref.stamp`), or the byte count does not
    match the dtype and shape.
    """
    if ref.mlx is not None:
        return unstored(_read_mlx(ref, dtype), ref)
    if ref.fp8 is not None:
        return unstored(_read_fp8(ref, dtype), ref)
    if ref.quantized:
        return unstored(_read_blocks(ref, dtype), ref)
    expected = ref.numel * ref.itemsize
    if ref.nbytes != expected:
        raise CheckpointError(
            f"nbytes {ref.nbytes} != {expected} for dtype {ref.dtype} shape {list(ref.shape)}",
            file=ref.path,
            tensor=ref.name,
        )
    out = read_bytes(ref).view(ref.torch_dtype).reshape(ref.shape)
    order = ref.row_order()
    return unstored(out if order is None else out[order], ref)


def _read_blocks(ref: TensorRef, dtype: torch.dtype) -> torch.Tensor:
    rows = ref.numel // ref.shape[-1]
    raw = read_bytes(ref).view(rows, ref.row_nbytes)  # whole blocks per row
    order = ref.row_order()
    if order is not None:
        raw = raw[order]
    out = torch.empty(ref.shape, dtype=dtype)
    try:
        return ggml.dequantize(raw, ref.dtype, shape=ref.shape, out=out)
    except ValueError as e:
        raise CheckpointError(str(e), file=ref.path, tensor=ref.name) from None


def _read_mlx(ref: TensorRef, dtype: torch.dtype) -> torch.Tensor:
    q = ref.mlx
    rows = ref.numel // ref.shape[-1]  # experts stacked [E, out, in] dequantize as E * out rows
    codes = read_bytes(ref).view(rows, -1)  # uint32 codes as bytes [rows, in * bits / 8]
    scales, biases = (read_tensor(t).view(rows, -1) for t in (q.scales, q.biases))  # [rows, in / group_size]
    out = torch.empty(ref.shape, dtype=dtype)
    try:
        return dequantize_mlx(codes, scales, biases, bits=q.bits, group_size=q.group_size, out=out)
    except ValueError as e:
        raise CheckpointError(str(e), file=ref.path, tensor=ref.name) from None


def _read_fp8(ref: TensorRef, dtype: torch.dtype) -> torch.Tensor:
    codes = read_bytes(ref).view(ref.shape)  # uint8 [..., out, in]: the e4m3 bytes
    scales = read_tensor(ref.fp8.scale, ref.fp8.scale.torch_dtype)  # [..., ceil(out / rows), ceil(in / inputs)]
    out = torch.empty(ref.shape, dtype=dtype)
    try:
        return dequantize_fp8(codes, scales, ref.fp8.block, out=out)
    except ValueError as e:
        raise CheckpointError(str(e), file=ref.path, tensor=ref.name) from None


def read_stored(ref: TensorRef, spec: QuantSpec) -> torch.Tensor:
    """`ref`'s stored bytes as `spec` lays them out (uint8 [spec.nbytes]): the blocks of a GGUF tensor as read, an FP8
    weight's codes and its block scales each at its part (quant/spec.py). Rows a GGUF converter permuted for rope
    come back in Hugging Face order (rows are whole blocks)."""
    if ref.fp8 is None:
        raw = read_bytes(ref)  # [nbytes]: whole blocks per row
        order = ref.row_order()  # rows llama.cpp permuted for its rope, back in Hugging Face order
        return raw if order is None else raw.view(ref.shape[0], ref.row_nbytes)[order].reshape(-1)
    raw = torch.zeros(spec.nbytes, dtype=torch.uint8)  # the padding between the parts stays zero
    for t, part in zip((ref, ref.fp8.scale), spec.parts):
        if t.nbytes != part.nbytes:
            raise CheckpointError(f"holds {t.nbytes} bytes where {part.name} {list(part.shape)} {part.dtype} takes "
                                  f"{part.nbytes}", file=t.path, tensor=t.name)
        raw[part.offset: part.offset + part.nbytes] = read_bytes(t)
    return raw
