"""One decode token of a Gated DeltaNet layer in one native call (deltanet.c): the conv's step over q | k | v, the
l2-normalised queries and keys, beta and the decay, the gated delta rule on the layer's float32 state, and the gated
RMSNorm of its output.

    step = DeltaNetDecode(n_k_heads, n_v_heads, k_head_dim, v_head_dim, conv_kernel, dtype, tiled=tiled,
                          path=path)  # per model; tiled: value head j reads key head j % n_k_heads, else j // r
    step.isa                      # the kernel it chose once, by this CPU and the path cap: "avx512", "avx2", "portable"
    layer = step.layer(conv, conv_state, state, neg_A, dt_bias, norm, eps)  # one per layer, checked once
    o = layer(qkv, z, b, a)       # [1, n_v_heads * v_head_dim] in dtype; conv_state and state updated in place
    y = DeltaNetFused(layer, ins, o_proj, planes, path)(x)   # bf16: projections, step and out_proj in one call

models/layers/gated_deltanet.py calls it for a decode token (T == 1) where the model's dtype is float32 or bf16; a
prompt keeps the chunked torch form. What it computes, and how it compares with the torch steps, is in deltanet.c's
header.
"""

from __future__ import annotations

import ctypes

import torch

from ._lib import BEST, LIB as _LIB

if _LIB is not None:
    _i64, _ptr, _i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    _LIB.sluice_deltanet_step.argtypes = (
        [_i64] * 5 + [_i32, _i32]  # nK, Hv, Dk, Dv, K, tiled, bf16
        + [_ptr] * 7  # qkv, z, b, a, conv_w, conv_state, neg_A
        + [_ptr, _ptr, ctypes.c_float, _ptr, _ptr, _ptr, _i32])  # dt_bias, norm, eps, state, scratch, out, kernel
    _LIB.sluice_deltanet_step.restype = None
    _LIB.sluice_deltanet_kernel.argtypes = [_i32]  # path
    _LIB.sluice_deltanet_kernel.restype = _i32
    _LIB.sluice_deltanet_decode.argtypes = [ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
    _LIB.sluice_deltanet_decode.restype = _i32
    _LIB.sluice_deltanet_decode_nargs.restype = _i32

#: the model dtypes the native step computes in (bf16: its roundings; float32: none)
DTYPES = (torch.float32, torch.bfloat16)
#: deltanet.c's kernels by the number sluice_deltanet_kernel gives (the same bits: its header says why)
KERNELS = ("portable", "avx2", "avx512")


def _tensor(t, what: str, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """t's address after checking it is a contiguous CPU tensor of `dtype` and `shape` (ValueError naming it)."""
    if not (isinstance(t, torch.Tensor) and t.dtype is dtype and t.device.type == "cpu" and t.is_contiguous()
            and tuple(t.shape) == shape):
        got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"DeltaNetDecode: {what} must be a contiguous CPU {dtype} tensor {list(shape)}, got {got}")
    return t.data_ptr()


class DeltaNetDecode:
    """The decode step of a model's Gated DeltaNet layers: their shapes, dtype and scratch (float32 [C + 2 Hv +
    3 Hv Dv] with C = 2 nK Dk + Hv Dv, the conv's channels; the layers run one at a time); `layer` checks a layer's
    constant arguments once and returns its call."""

    def __init__(self, n_k_heads: int, n_v_heads: int, k_head_dim: int, v_head_dim: int, conv_kernel: int,
                 dtype: torch.dtype, *, tiled: bool = False, path: int = BEST):
        """dtype: the model's (qkv, z, b, a, the conv's weight and state, the norm's weight and the output), float32
        or bf16; tiled: the value heads' order (spec.DeltaNetSpec.tiled): value head j reads key head j % n_k_heads
        (llama.cpp's qwen35 GGUFs), else j // (n_v_heads / n_k_heads) (grouped: transformers'); path: the model's
        Compute.path (native/_lib.py), which caps the kernel chosen here once: the best this CPU runs under it
        (`isa`), never looked up again per call."""
        if _LIB is None:
            raise RuntimeError("DeltaNetDecode needs the native extension (sluice.quant.native.available())")
        dims = (n_k_heads, n_v_heads, k_head_dim, v_head_dim, conv_kernel)
        if min(dims) < 1 or n_v_heads % n_k_heads:
            raise ValueError(f"DeltaNetDecode: n_v_heads {n_v_heads} must be a multiple of n_k_heads {n_k_heads} and "
                             f"every size positive, got {dims}")
        if dtype not in DTYPES:
            raise ValueError(f"DeltaNetDecode: dtype must be float32 or bfloat16, got {dtype}")
        self.nK, self.Hv, self.Dk, self.Dv, self.K = dims
        self.dtype, self.path, self.tiled = dtype, path, bool(tiled)
        self.kernel = _LIB.sluice_deltanet_kernel(path)
        self.isa = KERNELS[self.kernel]
        self.C = 2 * n_k_heads * k_head_dim + n_v_heads * v_head_dim
        self.scratch = torch.empty(self.C + 2 * n_v_heads + 3 * n_v_heads * v_head_dim, dtype=torch.float32)

    def layer(self, conv: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor, neg_A: torch.Tensor,
              dt_bias: torch.Tensor, norm: torch.Tensor, eps: float) -> "DeltaNetLayer":
        """The call of one layer: conv [C, 1, K] and norm [Dv] its weights (dtype), neg_A = -exp(A_log) and dt_bias
        float32 [Hv]; conv_state (dtype [C, K - 1]) and state (float32 [Hv, Dk, Dv]) the layer's cache, updated in
        place by each call."""
        x, C, K, Hv = self.dtype, self.C, self.K, self.Hv
        args = (_tensor(conv, "conv", x, (C, 1, K)), _tensor(conv_state, "conv_state", x, (C, K - 1)),
                _tensor(neg_A, "neg_A", torch.float32, (Hv,)), _tensor(dt_bias, "dt_bias", torch.float32, (Hv,)),
                _tensor(norm, "norm", x, (self.Dv,)), float(eps),
                _tensor(state, "state", torch.float32, (Hv, self.Dk, self.Dv)))
        return DeltaNetLayer(self, [conv, conv_state, neg_A, dt_bias, norm, state], args)


class DeltaNetFused:
    """A Gated DeltaNet layer's mixer at T = 1 in one native call (layer.c sluice_deltanet_decode): `(x) -> y`, x
    bf16 [1, H] (the input norm's output), y bf16 [1, H] (out_proj's): the grouped input projections `ins`
    (q8.LinearsQ8 of qkv, z, b, a), the layer's step, and out_proj `o` (q8.LinearsQ8 of one), each the same C call
    the separate wrappers make on the same values, so the same bits; their outputs in buffers of the layer's, written
    in place every token."""

    def __init__(self, layer: "DeltaNetLayer", ins, o, planes: int, path: int):
        s = layer.owner
        if s.dtype is not torch.bfloat16 or len(ins.ns) != 4 or len(o.ns) != 1:
            raise ValueError("DeltaNetFused: a bf16 layer with qkv, z, b, a grouped and one out_proj")
        nv = s.Hv * s.Dv
        if ins.ns != [s.C, nv, s.Hv, s.Hv] or o.k != nv:
            raise ValueError(f"DeltaNetFused: projections {ins.ns} -> {o.ns} do not fit the layer ({s.C}, {nv})")
        self.h = ins.k
        bufs = [torch.empty(1, n, dtype=torch.bfloat16) for n in ins.ns]  # qkv, z, b, a
        self.xf, self.o, self.of = torch.empty(self.h), torch.empty(1, nv, dtype=torch.bfloat16), torch.empty(nv)
        self.in_descs = ins.fixed(bufs)
        self.out_desc = o.fixed([torch.empty(1, o.ns[0], dtype=torch.bfloat16)])  # its y address set per call
        w, st, neg_A, dt_bias, norm, eps, state = layer._args
        vals = (s.nK, s.Hv, s.Dk, s.Dv, s.K, int(s.tiled), s.kernel, w, st, neg_A, dt_bias, norm, state,
                s.scratch.data_ptr(), self.h, 4, ctypes.addressof(self.in_descs), ctypes.addressof(self.out_desc),
                planes, path, self.xf.data_ptr(), self.o.data_ptr(), self.of.data_ptr())
        assert len(vals) == _LIB.sluice_deltanet_decode_nargs()
        self.p = (ctypes.c_int64 * len(vals))(*vals)
        self.eps = float(eps)
        self._keep = (layer, ins, o, bufs, s.scratch)  # what the addresses point in

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not (x.dtype is torch.bfloat16 and x.is_contiguous() and x.shape == (1, self.h)):
            raise ValueError(f"DeltaNetFused: x must be contiguous bf16 [1, {self.h}], got {x.dtype} {list(x.shape)}")
        y = torch.empty(1, self.h, dtype=torch.bfloat16)
        rc = _LIB.sluice_deltanet_decode(self.p, self.eps, x.data_ptr(), y.data_ptr())
        if rc:
            raise MemoryError(f"native deltanet_decode failed (code {rc}): no memory for its quantized rows")
        return y


class DeltaNetLayer:
    """DeltaNetDecode.layer's result: `(qkv, z, b, a) -> out`."""

    def __init__(self, owner: DeltaNetDecode, keep: list, args: tuple):
        self.owner, self._keep, self._args = owner, keep, args  # _keep: the tensors args point in

    def __call__(self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """One token's projections, each [1, n] in the model's dtype: qkv (n = C, before the conv), z (Hv Dv, the
        output gate), b and a (Hv) -> the gated norm's output [1, Hv Dv] (out_proj's input). The layer's conv state
        and recurrent state move on by this token."""
        s = self.owner
        x, Hv = s.dtype, s.Hv
        w, st, neg_A, dt_bias, norm, eps, state = self._args
        out = torch.empty(1, Hv * s.Dv, dtype=x)
        _LIB.sluice_deltanet_step(s.nK, Hv, s.Dk, s.Dv, s.K, int(s.tiled), int(x is torch.bfloat16),
                                  _tensor(qkv, "qkv", x, (1, s.C)), _tensor(z, "z", x, (1, Hv * s.Dv)),
                                  _tensor(b, "b", x, (1, Hv)), _tensor(a, "a", x, (1, Hv)), w, st, neg_A, dt_bias,
                                  norm, eps, state, s.scratch.data_ptr(), out.data_ptr(), s.kernel)
        return out
