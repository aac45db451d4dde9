"""kernels.c: y = x @ W^T from W's stored bytes on float32 dots, and the exact dequantization (float32, or rounded to
bf16 for a bf16 GEMM's operand).

    y = kernels.linear(spec, x, raw)          # x float32 [T, in] contiguous, raw uint8 [spec.nbytes] -> y [T, out]
    w = kernels.dequantize(spec, raw, out)    # the exact float32 weights [out, in]; into a bf16 out: rounded once

Formats: GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4 and the low-bit types (Q2_K, Q3_K, TQ1_0,
TQ2_0, IQ1_S - IQ4_XS: lowbit.c, portable C on every path) (stored blocks exactly as in the file), MLX
affine 4 / 8 bits with groups of 32, 64 or 128 and f32 / f16 / bf16 scales, gpt-oss MXFP4 (QuantSpec.mxfp4:
*_blocks and *_scales; code 8 is +0, as spec.dequantize has it), and FP8 e4m3 codes with their block scales
(QuantSpec.fp8: DeepSeek-V3 / Qwen3 FP8 `weight` + `weight_scale_inv`; fp8.h: the same bits on every path, dot
products included). Each output row's weights are dequantized exactly
(the value each weight has is sluice.quant.ggml.dequantize's, i.e. gguf's) and dotted with FMA in float32; the dot
products' order depends on in_features only, so the result is deterministic (whatever T, thread or row range) and
within ~1e-6 relative of F.linear on the exact weights. All rows go over the C pool (pool.c: output rows split; any
split gives the same bits); rows=(n0, n1) computes those output columns on the calling thread.
"""

from __future__ import annotations

import ctypes

import torch

from ..spec import QuantSpec
from ._lib import BEST, LIB, buffer, desc, need, x_out

if LIB is not None:
    _i64, _ptr, _i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    _DESC = [_i32, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i32, _i32]  # fmt, N, K, q, row_bytes, scales, biases, sdt, gs
    LIB.sluice_linear.argtypes = _DESC + [_ptr, _i64, _ptr, _i64, _i64, _i32]  # x, T, y, n0, n1, path
    LIB.sluice_linear.restype = _i32
    LIB.sluice_rows_pool.argtypes = _DESC + [_ptr, _i64, _ptr, _ptr, _i32]  # x, T, y (or NULL), out (or NULL), path
    LIB.sluice_rows_pool.restype = _i32
    LIB.sluice_dequantize_bf16.argtypes = _DESC + [_ptr, _i32]  # out16, path
    LIB.sluice_dequantize_bf16.restype = _i32


def _rows(rows: tuple[int, int] | None, n: int) -> tuple[int, int]:
    n0, n1 = (0, n) if rows is None else rows
    if not 0 <= n0 <= n1 <= n:
        raise ValueError(f"rows must be (n0, n1) with 0 <= n0 <= n1 <= {n}, got {rows}")
    return n0, n1


def _run(d: tuple, x: torch.Tensor, out: torch.Tensor, rows: tuple[int, int] | None, path: int) -> torch.Tensor:
    lib = need()
    if rows is None:  # all rows, split over the C pool: the same bits
        rc = lib.sluice_rows_pool(*d, x.data_ptr(), x.shape[0], out.data_ptr(), None, path)
    else:
        n0, n1 = _rows(rows, d[1])
        rc = lib.sluice_linear(*d, x.data_ptr(), x.shape[0], out.data_ptr(), n0, n1, path)
    if rc:
        raise MemoryError(f"native linear failed (code {rc}): no memory for a {d[2]}-value row buffer")
    return out


def linear(spec: QuantSpec, x: torch.Tensor, raw: torch.Tensor, out: torch.Tensor | None = None,
           rows: tuple[int, int] | None = None, *, path: int = BEST) -> torch.Tensor:
    """y [T, out] (float32) = x [T, in] (float32, contiguous) @ W^T, W from its stored bytes raw (uint8
    [spec.nbytes], spec.parts' layout). out: optional float32 [T, out] to write into. rows=(n0, n1): only those
    output columns are written, on this thread (each column is one whole dot product)."""
    d = desc(spec, raw)
    x, out = x_out(x, out, spec.out_features, spec.in_features)
    return _run(d, x, out, rows, path)


def dequantize(spec: QuantSpec, raw: torch.Tensor, out: torch.Tensor | None = None, *,
               path: int = BEST) -> torch.Tensor:
    """The float32 weights [out, in] of the stored bytes, bitwise spec.dequantize(raw), into out (float32,
    contiguous, out * in elements) or a new tensor; into a bf16 out, those weights rounded to bf16 (bitwise
    `.to(torch.bfloat16)` of them, without the float32 pass: a bf16 GEMM's operand). Rows over the pool."""
    lib = need()
    d = desc(spec, raw)
    n, k = spec.out_features, spec.in_features
    if out is None:
        out = torch.empty(n, k)
    if out.dtype is torch.bfloat16:
        buffer(out, f"out ([{n}, {k}])", torch.bfloat16, n * k)
        if lib.sluice_dequantize_bf16(*d, out.data_ptr(), path):
            raise MemoryError(f"native dequantize: no memory for a {k}-value row buffer")
        return out.view(n, k)
    buffer(out, f"out ([{n}, {k}])", torch.float32, n * k)
    lib.sluice_rows_pool(*d, None, 0, None, out.data_ptr(), path)  # rows over the pool
    return out.view(n, k)
