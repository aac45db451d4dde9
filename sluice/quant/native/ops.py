"""ops.c: the small elementwise steps of a bf16 model (RMSNorm rows, rope, the weighted sums of expert outputs), each
bitwise its torch expression (RMSNorm to the last bit of a row's scale), in one native call instead of tens of torch
ops (~4-10 us each at one row here). Rows go over the C pool; `path` (native/_lib.py) picks the AVX2 or the portable
loops, the same bits.

    out = ops.rms_norm_bf16(x, w, eps); y = ops.rope_bf16(x, cos, sin)
    out = ops.rms_norm_scaled_bf16(x, 1 + w.float(), eps)   # the zero-centred norm (Qwen3-Next, Qwen3.5)
    ops.combine_bf16(ys, w, at, out)          # decode: a token's expert outputs, weighted, summed in order
    ops.combine_rows_bf16(ys, w, at, out)     # a prompt's weighted sum of its expert outputs
    z = ops.add_bf16(x, y)                    # a prompt's residual add, torch's x + y
    xf = ops.to_float32(x)                    # bf16 rows widened (exact) for a float32 GEMM
"""

from __future__ import annotations

import ctypes

import torch

from ._lib import BEST, LIB

if LIB is not None:
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    LIB.sluice_combine_bf16.argtypes = [i64, ptr, i64, ptr, i32, ptr, ptr, i32]  # n, ys, H, w, w_f32, at, out, path
    LIB.sluice_combine_bf16.restype = None
    # T, K, H, ys, w, w_f32, at, out, path
    LIB.sluice_combine_rows_bf16.argtypes = [i64, i64, i64, ptr, ptr, i32, ptr, ptr, i32]
    LIB.sluice_combine_rows_bf16.restype = None
    LIB.sluice_rms_norm_bf16.argtypes = [i64, i64, ptr, ptr, ctypes.c_float, ptr, i32]  # rows, n, x, w, eps, out, path
    LIB.sluice_rms_norm_bf16.restype = None
    LIB.sluice_rms_norm_scaled_bf16.argtypes = LIB.sluice_rms_norm_bf16.argtypes  # w float32
    LIB.sluice_rms_norm_scaled_bf16.restype = None
    # heads, T, D, rot, x, head stride, token stride, cos, sin, out, path
    LIB.sluice_rope_bf16.argtypes = [i64, i64, i64, i64, ptr, i64, i64, ptr, ptr, ptr, i32]
    LIB.sluice_rope_bf16.restype = None
    LIB.sluice_add_bf16.argtypes = [i64, ptr, ptr, ptr, i32]  # n, a, b, out, path
    LIB.sluice_add_bf16.restype = None
    LIB.sluice_bf16_to_f32.argtypes = [i64, ptr, ptr, i32]  # n, x, out, path
    LIB.sluice_bf16_to_f32.restype = None


def combine_bf16(ys: torch.Tensor, w: torch.Tensor, at: list[int], out: torch.Tensor, *, path: int = BEST) -> None:
    """out (bf16 [1, H]) += each row of ys (float32 [n, H]) times its routing weight w[0, at[j]] (w bf16 or float32
    [1, K]), in row order: bitwise `for j: out += ((ys.to(bf16) * w[0, at].unsqueeze(1)).to(bf16))[j]` (ops.c), one
    call instead of ~20 torch ops."""
    n, h = ys.shape
    if not (ys.dtype is torch.float32 and ys.is_contiguous() and out.dtype is torch.bfloat16 and out.is_contiguous()
            and out.numel() == h and w.dtype in (torch.bfloat16, torch.float32) and w.is_contiguous()
            and w.dim() == 2 and w.shape[0] == 1 and len(at) == n and all(0 <= a < w.shape[1] for a in at)):
        raise ValueError(f"combine_bf16: need ys float32 [n, H], w bf16/float32 [1, K], n positions < K and out bf16 "
                         f"[1, H], got {ys.dtype} {list(ys.shape)}, {w.dtype} {list(w.shape)}, {len(at)}, "
                         f"{out.dtype} {list(out.shape)}")
    LIB.sluice_combine_bf16(n, ys.data_ptr(), h, w.data_ptr(), int(w.dtype is torch.float32),
                             (ctypes.c_int64 * n)(*at), out.data_ptr(), path)


def combine_rows_bf16(ys: torch.Tensor, w: torch.Tensor, at: torch.Tensor, out: torch.Tensor, *,
                      path: int = BEST) -> torch.Tensor:
    """A prompt's weighted sum of expert outputs (ops.c): out[t] = sum over r of ys[at[t, r]] * w[at[t, r]], each
    product rounded to bf16 and added to out (from zeros) in r order; bitwise `ys.mul_(w[:, None])` then `out =
    zeros; for r: out += ys[at[:, r]]`, without changing ys. ys bf16 [T*K, H], w bf16 / float32 [T*K], at int64
    [T, K] (rows of ys, checked), out bf16 [T, H]; tokens split over the C pool."""
    T, K = at.shape
    n, h = ys.shape
    if not (ys.dtype is torch.bfloat16 and out.dtype is torch.bfloat16 and w.dtype in (torch.bfloat16, torch.float32)
            and at.dtype is torch.int64 and all(t.is_contiguous() for t in (ys, w, at, out))
            and w.numel() == n and tuple(out.shape) == (T, h) and (at.numel() == 0 or 0 <= int(at.min()) and
                                                                   int(at.max()) < n)):
        raise ValueError(f"combine_rows_bf16: need ys bf16 [n, H], w bf16/float32 [n], at int64 [T, K] of rows < n "
                         f"and out bf16 [T, H], got {ys.dtype} {list(ys.shape)}, {w.dtype} {list(w.shape)}, "
                         f"{at.dtype} {list(at.shape)}, {out.dtype} {list(out.shape)}")
    LIB.sluice_combine_rows_bf16(T, K, h, ys.data_ptr(), w.data_ptr(), int(w.dtype is torch.float32),
                                 at.data_ptr(), out.data_ptr(), path)
    return out


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float, *, path: int = BEST) -> torch.Tensor:
    """RMSNorm of bf16 x [..., n] (contiguous) with bf16 weight [n] (ops.c): the reference's steps (float32
    statistics, the row rounded to bf16, times the weight) in one call instead of eight torch ops (~45 us at one
    1024-wide row here); its sum of squares is in a fixed order of its own, so the scale may differ from torch's in
    the last bit."""
    return _row_norm(LIB.sluice_rms_norm_bf16, "rms_norm_bf16", "bf16 weight", x, weight, torch.bfloat16, eps, path)


def rms_norm_scaled_bf16(x: torch.Tensor, scale: torch.Tensor, eps: float, *, path: int = BEST) -> torch.Tensor:
    """The zero-centred RMSNorm of bf16 x [..., n] (contiguous) by a float32 scale [n] (1 + the stored weight, as
    models/layers/norm.py Norm holds it), in one native call (ops.c): `(x.float() * rsqrt(mean(x^2) + eps) *
    scale).to(bf16)`, one rounding, instead of seven torch ops; the sum of squares as rms_norm_bf16's, so the row's
    scale may differ from torch's in the last bit."""
    return _row_norm(LIB.sluice_rms_norm_scaled_bf16, "rms_norm_scaled_bf16", "float32 scale", x, scale,
                     torch.float32, eps, path)


def _row_norm(fn, name: str, what: str, x: torch.Tensor, w: torch.Tensor, w_dtype: torch.dtype, eps: float,
              path: int) -> torch.Tensor:
    """The two norms' checks and call: fn(rows, n, x, w, eps, out, path) on contiguous bf16 x [..., n], w [n]."""
    n = x.shape[-1]
    if not (x.dtype is torch.bfloat16 and w.dtype is w_dtype and x.is_contiguous() and w.is_contiguous()
            and w.numel() == n and x.device.type == "cpu"):
        raise ValueError(f"{name}: need contiguous bf16 x [..., n] and {what} [n], got {x.dtype} {list(x.shape)} and "
                         f"{w.dtype} {list(w.shape)}")
    out = torch.empty_like(x)
    fn(x.numel() // n if n else 0, n, x.data_ptr(), w.data_ptr(), eps, out.data_ptr(), path)
    return out


def rope_bf16(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, path: int = BEST) -> torch.Tensor:
    """models/rope.py apply_rope for bf16 x [heads, T, D] (any strides, unit last stride) and bf16 cos / sin [T, rot]
    contiguous, in one native call (ops.c): bitwise its torch expression, a new contiguous [heads, T, D]."""
    heads, t, d = x.shape
    rot = cos.shape[-1]
    if not (x.dtype is torch.bfloat16 and cos.dtype is torch.bfloat16 and sin.dtype is torch.bfloat16
            and x.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous() and cos.shape == (t, rot)
            and sin.shape == (t, rot) and rot % 2 == 0 and rot <= d):
        raise ValueError(f"rope_bf16: need bf16 x [heads, T, D] with unit last stride and contiguous bf16 cos / sin "
                         f"[T, rot <= D], got {x.dtype} {list(x.shape)} stride {x.stride()}, {cos.dtype} "
                         f"{list(cos.shape)}, {sin.dtype} {list(sin.shape)}")
    out = torch.empty(heads, t, d, dtype=torch.bfloat16)
    LIB.sluice_rope_bf16(heads, t, d, rot, x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
                         out.data_ptr(), path)
    return out


def add_bf16(a: torch.Tensor, b: torch.Tensor, *, path: int = BEST) -> torch.Tensor:
    """a + b for bf16 tensors of one shape (contiguous) into a new tensor: bitwise torch's `a + b` (float32 sums
    rounded to nearest even; a NaN as 0x7fc0), in blocks over the C pool."""
    if not (a.dtype is b.dtype is torch.bfloat16 and a.shape == b.shape and a.is_contiguous() and b.is_contiguous()
            and a.is_cpu and b.is_cpu):
        raise ValueError(f"add_bf16: need two contiguous CPU bf16 tensors of one shape, got {a.dtype} "
                         f"{list(a.shape)} and {b.dtype} {list(b.shape)}")
    out = torch.empty_like(a)
    LIB.sluice_add_bf16(a.numel(), a.data_ptr(), b.data_ptr(), out.data_ptr(), path)
    return out


def to_float32(x: torch.Tensor, *, path: int = BEST) -> torch.Tensor:
    """x (contiguous CPU bf16) widened to a new float32 tensor, bitwise x.float(), in blocks over the C pool."""
    if not (x.dtype is torch.bfloat16 and x.is_contiguous() and x.is_cpu):
        raise ValueError(f"to_float32: need a contiguous CPU bf16 tensor, got {x.dtype} {list(x.shape)}")
    out = torch.empty(x.shape, dtype=torch.float32)
    LIB.sluice_bf16_to_f32(x.numel(), x.data_ptr(), out.data_ptr(), path)
    return out
