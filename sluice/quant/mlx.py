"""MLX affine quantization (the mlx-community layout) -> values.

A quantized Linear [out, in] is three tensors: `weight` uint32 [out, in * bits / 32], each row a little-endian
bitstream of `bits`-bit codes, lowest bits first (for 4 bits: value 8j + k is bits 4k..4k+3 of word j); `scales`
and `biases` [out, in / group_size] (bf16 / f16 / f32); value = scale * q + bias per group.

Exactness: `mlx.core.dequantize` computes `multiply(q, scales)` then `add(..., biases)` in the scales' dtype. Here
the scales and biases are first widened to float32 (exact), then the same two ops run in float32, one rounding each;
so the result is bitwise equal to `mx.dequantize(w, scales.astype(float32), biases.astype(float32))`, and to
`mx.dequantize(w, scales, biases)` itself when those are float32. With bf16 scales MLX rounds to bf16 after the
multiply and after the add; our float32 values differ from its by at most those two roundings (relative 2^-8 of
the larger of scale * q and the bias), which is what `dtype="float32"` should remove, not reproduce.
"""

from __future__ import annotations

import torch

from ..checkpoint.formats import MLX_BITS as BITS
from .affine import Affine


def unpack_codes(weight: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """uint32 (or its bytes) [rows, n * bits / 32] -> uint8 codes [rows, n] (LSB-first bitstream per row)."""
    if bits not in BITS:
        raise ValueError(f"MLX affine quantization has {BITS} bits, got {bits}")
    rows = weight.shape[0]
    by = weight.contiguous().view(torch.uint8).view(rows, -1)  # little-endian: byte 0 = bits 0-7 of word 0
    if by.shape[1] * 8 != n * bits:
        raise ValueError(f"a row of {n} {bits}-bit codes takes {n * bits // 8} bytes, got {by.shape[1]}")
    if bits == 8:
        return by
    if bits == 4:
        return torch.stack((by & 15, by >> 4), dim=-1).view(rows, n)
    if bits == 2:
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
        return ((by.unsqueeze(-1) >> shifts) & 3).view(rows, n)
    # 3, 5, 6 bits: every `bits` bytes hold 8 codes; code k starts at bit k * bits and spans at most two bytes
    chunk = torch.nn.functional.pad(by.view(rows, -1, bits).to(torch.int16), (0, 1))  # one zero byte past the end
    codes = torch.empty(rows, n // 8, 8, dtype=torch.uint8)
    for k in range(8):  # over the 8 positions of a chunk (a fixed pattern), not over blocks
        at, shift = divmod(k * bits, 8)
        pair = chunk[..., at] | (chunk[..., at + 1] << 8)
        codes[..., k] = (pair >> shift) & ((1 << bits) - 1)
    return codes.view(rows, n)


def mlx_affine(weight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, *, bits: int,
               group_size: int, codes: bool = True) -> Affine:
    """MLX affine tensors -> Affine(codes uint8 [out, in], scale and bias widened to float32 [out, in/group]).

    weight: uint32 [out, in * bits / 32] (or the same bytes as uint8 / int32); scales, biases: [out, in / group_size]
    floating point (bf16 / f16 / f32). codes=False skips unpacking the codes (Affine.codes is None).
    """
    if weight.dim() != 2 or scales.dim() != 2 or scales.shape != biases.shape or scales.shape[0] != weight.shape[0]:
        raise ValueError(f"MLX weight must be [out, packed] with scales and biases [out, groups], got "
                         f"{tuple(weight.shape)}, {tuple(scales.shape)}, {tuple(biases.shape)}")
    if not (scales.is_floating_point() and biases.is_floating_point()):
        raise ValueError(f"MLX scales and biases must be floating point, got {scales.dtype} and {biases.dtype}")
    rows, groups = scales.shape
    if bits not in BITS:
        raise ValueError(f"MLX affine quantization has {BITS} bits, got {bits}")
    if weight.numel() * weight.element_size() * 8 != rows * groups * group_size * bits:
        raise ValueError(f"a row of {groups * group_size} {bits}-bit codes takes {groups * group_size * bits // 8} "
                         f"bytes, got {weight.numel() * weight.element_size() // max(rows, 1)}")
    q = unpack_codes(weight, bits, groups * group_size) if codes else None
    return Affine(q, scales.float(), biases.float(), group_size)  # widening to float32 is exact


def dequantize_mlx(weight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, *, bits: int, group_size: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """MLX affine -> float32 [out, in] values (scale * q, then + bias, in float32: see the module docstring), or
    written into `out` (contiguous float32 / bfloat16 / float16 of out * in elements; returned)."""
    return mlx_affine(weight, scales, biases, bits=bits, group_size=group_size).dequantize(out)
