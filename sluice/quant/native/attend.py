"""A prompt's causal attention in one native call: attend.c where the CPU has AVX512_BF16, attend_avx2.c (float32
products and probabilities) on AVX2 + FMA, or its portable twin (the same bits).

    from sluice.quant.native import attend
    attend.available()                 # the extension is built and the CPU has AVX512_BF16
    out = attend.causal(q, k, v, pos)  # q bf16 [nH, T, D], k / v the bf16 caches [nKV, >= pos + T, D] -> [T, nH * D]
    attend.available(float32=True)     # the extension is built: attend_avx2.c (AVX2 + FMA, or its portable twin)
    out = attend.causal(q, k, v, pos, float32=True, path=BEST)

The queries sit at positions pos .. pos + T - 1 and see the keys 0 .. their own position; query head h reads kv head
h // (nH // nKV). Scores are float32 sums of bf16 products times D^-0.5, the softmax runs online per block of 64
keys, the probabilities are rounded to bf16 before they weight v (as quant/matmul.py sdpa's bf16 dot products round them),
and the result is rounded to bf16 once. Against a float64 reference it is about as close as matmul.sdpa (relative
error 1.7e-3 - 2.0e-3 against its 1.6e-3 on random inputs; tests/quant/test_attend.py bounds it at 1.3x sdpa's) in
less than half its time: 2,048 tokens, 8 / 2 heads of 128, 13.3-13.6 vs 28.4-30.1 ms
(`.venv/bin/python benchmarks/prefill/knobs.py attend`).

With float32=True (attend_avx2.c, for CPUs whose prompt GEMMs are float32: no AVX512_BF16, or --isa avx2 / portable)
the same flash order runs on AVX2 FMAs (`path` PORTABLE, or no AVX2 + FMA: its portable twin, the same bits) with the
probabilities kept in float32, so it is closer to the float64 reference than
torch's SDPA on the same bf16 inputs (tests/quant/test_attend_avx2.py).
"""

from __future__ import annotations

import ctypes

import torch

from ._lib import BEST
from ._lib import LIB as _LIB

if _LIB is not None:
    _i64 = ctypes.c_int64
    _LIB.sluice_attention_bf16.restype = ctypes.c_int
    # nH, nKV, T, D, pos, q, q head / position strides, k, v, kv head stride, scale, out
    _LIB.sluice_prompt_attention.argtypes = [_i64] * 5 + [ctypes.c_void_p, _i64, _i64, ctypes.c_void_p,
                                                          ctypes.c_void_p, _i64, ctypes.c_float, ctypes.c_void_p]
    _LIB.sluice_prompt_attention.restype = ctypes.c_int
    _LIB.sluice_prompt_attention_f32.argtypes = _LIB.sluice_prompt_attention.argtypes + [ctypes.c_int]
    _LIB.sluice_prompt_attention_f32.restype = ctypes.c_int


def available(float32: bool = False) -> bool:
    """Whether causal() runs here: the extension is built and the CPU has AVX512_BF16 (float32: the extension alone)."""
    if _LIB is None:
        return False
    return True if float32 else bool(_LIB.sluice_attention_bf16())


def supports(n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
    """Whether attend.c takes these heads: head_dim a multiple of 32 up to 512, at most 16 query heads per kv head."""
    return (n_kv_heads >= 1 and n_heads >= 1 and n_heads % n_kv_heads == 0 and n_heads // n_kv_heads <= 16 and head_dim % 32 == 0
            and head_dim <= 512)


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, float32: bool = False,
           path: int = BEST) -> torch.Tensor:
    """out bf16 [T, nH * D] = causal attention of q (bf16 [nH, T, D], unit stride along D) at positions pos .. pos +
    T - 1 over the caches k and v (bf16 [nKV, P, D], P >= pos + T, each position's D values contiguous); float32:
    attend_avx2.c's float32 kernel rather than attend.c's bf16 one, on the model's `path` (Compute.path)."""
    if not available(float32):
        need = "" if float32 else " and a CPU with AVX512_BF16"
        raise RuntimeError(f"attend.causal needs the native extension{need} (available())")
    if not (q.dtype is torch.bfloat16 and q.dim() == 3 and q.is_cpu and q.stride(2) == 1):
        raise ValueError(f"q must be a CPU bf16 [nH, T, D] tensor with unit stride along D, got {q.dtype} "
                         f"{list(q.shape)} on {q.device}")
    nh, t, d = q.shape
    for name, c in (("k", k), ("v", v)):
        if not (c.dtype is torch.bfloat16 and c.dim() == 3 and c.is_cpu and c.shape[2] == d and c.stride(2) == 1
                and c.stride(1) == d and c.shape[1] >= pos + t):
            raise ValueError(f"{name} must be a bf16 cache [nKV, >= {pos + t}, {d}], positions contiguous, got "
                             f"{c.dtype} {list(c.shape)} strides {c.stride()}")
    nkv = k.shape[0]
    if v.shape[0] != nkv or v.stride(0) != k.stride(0):
        raise ValueError(f"attend.causal: k and v must have the same kv heads and head stride, got {list(k.shape)} "
                         f"/ {list(v.shape)} strides {k.stride(0)} / {v.stride(0)}")
    if not supports(nh, nkv, d) or pos < 0:
        raise ValueError(f"attend.causal: unsupported heads ({nh} query, {nkv} kv, dim {d}) or position {pos}")
    out = torch.empty(t, nh * d, dtype=torch.bfloat16)
    if t == 0:
        return out
    args = (nh, nkv, t, d, pos, q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), k.stride(0),
            d ** -0.5, out.data_ptr())
    rc = _LIB.sluice_prompt_attention_f32(*args, path) if float32 else _LIB.sluice_prompt_attention(*args)
    if rc == -1:
        raise MemoryError(f"attend.causal: no memory for the [{nkv} x {pos + t} x {d}] key / value layout")
    if rc:
        raise ValueError(f"attend.causal: the kernel refused its arguments (code {rc})")
    return out
