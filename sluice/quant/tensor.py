"""read_tensor: one whole tensor read (io/tensor.py read_bytes) and turned into a torch tensor: plain dtypes as
stored, block formats and MLX affine weights dequantized (bitwise the gguf / mx.dequantize reference in float32)."""

from __future__ import annotations

import torch

from ..checkpoint.ref import TensorRef, unstored
from ..errors import CheckpointError
from ..io.tensor import read_bytes
from . import ggml
from .mlx import dequantize_mlx


def read_tensor(ref: TensorRef, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Read `ref`'s bytes into a fresh tensor of `ref.torch_dtype` and `ref.shape` (scalars and empty tensors too).

    A tensor in a block format (GGUF Q4_K, ...) or an MLX affine weight (`ref.mlx`: its codes, scales and biases
    are read) comes back dequantized, in `dtype` (bitwise the gguf / mx.dequantize reference in float32; another
    dtype is that value rounded once). Rows a GGUF converter permuted for llama.cpp's rope
    (`ref.rope_heads`) come back in Hugging Face order, values a converter mapped (`ref.values`: a norm stored as
    1 + w, ...) as the Hugging Face values. Raises CheckpointError (naming the file and tensor) when the
    file is missing, short, not the version its header was read from (`ref.stamp`), or the byte count does not
    match the dtype and shape.
    """
    if ref.mlx is not None:
        return unstored(_read_mlx(ref, dtype), ref)
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
