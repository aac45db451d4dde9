"""The gated delta rule over a prompt in one native call per layer (delta_prompt.c): models/layers/delta_rule.py's
`chunked` (its reference) with the l2 norm of q and k, q's scale and the key heads' pairing with the value heads
inside, on the layer's float32 state.

    rule = DeltaRulePrompt(n_k_heads, n_v_heads, k_head_dim, v_head_dim, dtype, tiled=tiled, path=path)  # per model
    rule.isa                       # its kernel, chosen once by this CPU and the path cap: "avx512", "avx2", "portable"
    o = rule(q, k, v, g, beta, state)   # chunked's arguments, q and k not repeated; state moved on in place
    y = rule.conv(qkv, w, conv_state)   # the causal conv with silu before it; conv_state moved on in place

models/layers/gated_deltanet.py calls it for a prompt (T > 1) where the model computes in float32 or bf16
(Build.delta_prompt, Kernels.native_delta_prompt); delta_rule.chunked stays the reference and runs other dtypes
(float64 in tests). What it computes, and how close to chunked, is in delta_prompt.c's header.
"""

from __future__ import annotations

import ctypes

import torch

from ._lib import BEST, LIB as _LIB
from .deltanet import DTYPES, KERNELS

if _LIB is not None:
    _i64, _ptr, _i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    _LIB.sluice_delta_prompt.argtypes = (
        [_i64] * 5 + [_i32, _i32]  # T, nK, Hv, Dk, Dv, tiled, bf16
        + [_ptr, _i64, _ptr, _i64, _ptr, _i64]  # q, ldq, k, ldk, v, ldv
        + [_ptr, _ptr, _ptr, _ptr, _i32])  # g, beta, state, out, kernel
    _LIB.sluice_delta_prompt.restype = _i32
    _LIB.sluice_conv_prompt.argtypes = [_i64] * 3 + [_ptr, _i64, _ptr, _ptr, _ptr, _i32, _i32]
    _LIB.sluice_conv_prompt.restype = _i32


CONV_MAX_TAPS = 8  # delta_prompt.c CONV_MAX_K: the taps the native conv takes (Qwen3.5 / Qwen3-Next: 4)


def _checked(t, what: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """t, after checking it is a CPU tensor of `dtype` and `shape` (ValueError naming it)."""
    if not (isinstance(t, torch.Tensor) and t.dtype is dtype and t.device.type == "cpu" and tuple(t.shape) == shape):
        got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"DeltaRulePrompt: {what} must be a CPU {dtype} tensor {list(shape)}, got {got}")
    return t


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [T, heads, D] as the kernel reads it: each token's heads one row after another, any stride between tokens
    (a slice of the conv's output as it is); copied when they are not (a view of the conv's transposed output)."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.stride(0) >= t.shape[1] * t.shape[2] else (
        t.contiguous())


class DeltaRulePrompt:
    """The chunked rule of a model's Gated DeltaNet layers: their head counts and sizes, the dtype and the kernel,
    fixed when the model is built; a call runs one layer's prompt (the layers share the object)."""

    def __init__(self, n_k_heads: int, n_v_heads: int, k_head_dim: int, v_head_dim: int, dtype: torch.dtype, *,
                 tiled: bool = False, path: int = BEST):
        """dtype: the model's (q, k, v, beta and the output), float32 or bf16; tiled: value head j reads key head
        j % n_k_heads (llama.cpp's qwen35 GGUFs), else j // (n_v_heads / n_k_heads) (grouped: transformers'); path:
        the model's Compute.path (native/_lib.py), which caps the kernel chosen here once (`isa`)."""
        if _LIB is None:
            raise RuntimeError("DeltaRulePrompt needs the native extension (sluice.quant.native.available())")
        dims = (n_k_heads, n_v_heads, k_head_dim, v_head_dim)
        if min(dims) < 1 or n_v_heads % n_k_heads:
            raise ValueError(f"DeltaRulePrompt: n_v_heads {n_v_heads} must be a multiple of n_k_heads {n_k_heads} "
                             f"and every size positive, got {dims}")
        if dtype not in DTYPES:
            raise ValueError(f"DeltaRulePrompt: dtype must be float32 or bfloat16, got {dtype}")
        self.nK, self.Hv, self.Dk, self.Dv = dims
        self.dtype, self.path, self.tiled = dtype, path, bool(tiled)
        self.kernel = _LIB.sluice_deltanet_kernel(path)
        self.isa = KERNELS[self.kernel]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor) -> torch.Tensor:
        """q, k [T, n_k_heads, Dk] (before the l2 norm, not repeated), v [T, n_v_heads, Dv], beta [T, n_v_heads] in
        the dtype; g [T, n_v_heads] float32; state [n_v_heads, Dk, Dv] float32, moved past the T tokens in place ->
        the rule's output [T, n_v_heads, Dv] in the dtype."""
        x, Hv, Dk, Dv = self.dtype, self.Hv, self.Dk, self.Dv
        T = q.shape[0] if isinstance(q, torch.Tensor) else -1
        q, k = (_rows(_checked(t, n, x, (T, self.nK, Dk))) for t, n in ((q, "q"), (k, "k")))
        v = _rows(_checked(v, "v", x, (T, Hv, Dv)))
        g, beta = _checked(g, "g", torch.float32, (T, Hv)).contiguous(), _checked(beta, "beta", x, (T, Hv)).contiguous()
        if not _checked(state, "state", torch.float32, (Hv, Dk, Dv)).is_contiguous():
            raise ValueError("DeltaRulePrompt: state must be contiguous (it is moved on in place)")
        out = torch.empty(T, Hv, Dv, dtype=x)
        if _LIB.sluice_delta_prompt(T, self.nK, Hv, Dk, Dv, int(self.tiled), int(x is torch.bfloat16), q.data_ptr(),
                                    q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), g.data_ptr(),
                                    beta.data_ptr(), state.data_ptr(), out.data_ptr(), self.kernel):
            raise MemoryError("DeltaRulePrompt: no memory for a thread's block scratch (~260 KiB); the layer's state "
                              "is now partly moved on: start the prompt again at position 0")
        return out

    def conv(self, qkv: torch.Tensor, w: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The causal depthwise conv before the rule, with silu (delta_prompt.c sluice_conv_prompt, the decode
        step's arithmetic token by token): qkv [T, C] (rows with any stride), w [C, 1, K] and state [C, K - 1] (the
        layer's last K - 1 inputs, moved past the T tokens in place) in the dtype -> [T, C] in the dtype."""
        x = self.dtype
        C, K = (w.shape[0], w.shape[2]) if isinstance(w, torch.Tensor) and w.dim() == 3 else (-1, -1)
        T = qkv.shape[0] if isinstance(qkv, torch.Tensor) and qkv.dim() == 2 else -1
        w = _checked(w, "conv weight", x, (C, 1, K))
        qkv = _checked(qkv, "qkv", x, (T, C))
        if not _checked(state, "conv state", x, (C, K - 1)).is_contiguous() or not w.is_contiguous():
            raise ValueError("DeltaRulePrompt.conv: the conv's weight and state must be contiguous")
        if qkv.stride(1) != 1:
            qkv = qkv.contiguous()
        out = torch.empty(T, C, dtype=x)
        if _LIB.sluice_conv_prompt(T, C, K, qkv.data_ptr(), qkv.stride(0), w.data_ptr(), state.data_ptr(),
                                   out.data_ptr(), int(x is torch.bfloat16), self.kernel):
            raise ValueError(f"DeltaRulePrompt.conv: a conv of {K} taps; the native conv takes 1 to {CONV_MAX_TAPS}")
        return out
