"""One decode token's attention core and softmax router probabilities as single native calls (decode.c).

    attend = DecodeAttention(n_heads, n_kv_heads, head_dim, cos, sin)  # one per model: scratch and rope tables
    layer = attend.layer(cache_k, cache_v, norm="head", q_norm=..., ...)  # one per layer, checked once
    out = layer(q, k, v, pos, lo)                           # [1, nH * D] bf16; k and v written to the caches
    out = layer(q, k, v, pos, lo, gate=gate)                # gated attention: times sigmoid(gate)
    y = AttentionFused(layer, qkv, o_proj, gated, planes, path)(x, pos, lo)   # projections, core, o_proj: one call
    probs = router_probs_bf16(x, router)                    # softmax(F.linear(x, router)) in float32, [1, E]

models/layers/attention.py and moe.py call them for a bf16 decode step (T == 1); everything else keeps the torch
code. What they compute, and how it compares with the torch expressions, is in decode.c's header.
"""

from __future__ import annotations

import ctypes
import importlib.util
import struct

import torch

from ._lib import BEST, LIB as _LIB, build_compiler

if _LIB is not None:
    _i64, _ptr, _i32, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    _LIB.sluice_attend_bf16.argtypes = (
        [_i64] * 4 + [_ptr] * 3  # nH, nKV, D, rot, q, k, v
        + [_i32, _ptr, _ptr, _i32, _f32, _f32]  # norm_mode, qn, kn, norm_f32, eps, clip
        + [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64]  # cos, sin, ck, cv, sh, sp, pos, lo
        + [_ptr, _ptr, _ptr, _ptr, _ptr, _i32])  # sinks, rq, scratch, gate, out, scalar
    _LIB.sluice_router_probs_bf16.argtypes = [_i64, _i64, _ptr, _ptr, _ptr, _i32]  # E, H, x, w, probs, scalar
    _LIB.sluice_attend_bf16.restype = _LIB.sluice_router_probs_bf16.restype = None
    # p, eps, clip, x, pos, lo, out (layer.c)
    _LIB.sluice_attention_decode.argtypes = [_ptr, _f32, _f32, _ptr, _i64, _i64, _ptr]
    _LIB.sluice_attention_decode.restype = _i32
    _LIB.sluice_attention_decode_nargs.restype = _i32
    # E, probs, k, norm, bf16, ties (topk.cc's function, or None), ids, weights f32, weights bf16
    _LIB.sluice_topk_probs.argtypes = [_i64, _ptr, _i64, _i32, _i32, _ptr, _ptr, _ptr, _ptr]
    _LIB.sluice_topk_probs.restype = _i32
    # E, H, x, scale, eps, norm's path, router, k, ties, hb, probs, ids, wf, router's path
    _LIB.sluice_guess_bf16.argtypes = [_i64, _i64, _ptr, _ptr, _f32, _i32, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr,
                                       _i32]
    _LIB.sluice_guess_bf16.restype = _i32


def _load_topk() -> ctypes.CDLL | None:
    """topk.cc's extension (C++: absent where no C++ compiler built it; ties then go to torch.topk)."""
    spec = importlib.util.find_spec("sluice.quant.native._topk")
    if spec is None or spec.origin is None:
        return None
    lib = ctypes.CDLL(spec.origin)
    lib.sluice_topk_torch.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_void_p]  # n, values, k, ids, values out
    lib.sluice_topk_torch.restype = ctypes.c_int
    lib.sluice_topk_libstdcxx.restype = ctypes.c_int
    return lib


def cxx_compiler() -> str | None:
    """The C++ compiler setuptools builds topk.cc with, if it is on PATH ($CXX, else Python's, else c++)."""
    return build_compiler("CXX", "c++")


def topk_unbuilt() -> bool:
    """Whether topk.cc's extension is missing although a C++ compiler is here: a failed build (the Makefile's stamp
    and tests/conftest.py stop on it; with no C++ compiler, ties go to torch.topk)."""
    return _TOPK is None and cxx_compiler() is not None


def ties_expected() -> bool:
    """Whether topk.cc must give torch.topk's tie order on this build: built against libstdc++, the C++ library
    torch's Linux wheels are built with (the same nth_element / sort). Built against another (libc++), its order may
    differ and ties_exact finds out; the tests of the order then skip, saying so."""
    return _TOPK is not None and bool(_TOPK.sluice_topk_libstdcxx())


_TOPK = _load_topk()
#: sluice_topk_torch's address, for decode.c's topk_fn arguments (None without the extension)
_TOPK_FN = None if _TOPK is None else ctypes.cast(_TOPK.sluice_topk_torch, ctypes.c_void_p).value

#: norm modes of DecodeAttention: Spec.qk_norm -> the C code's number
NORM_MODES = {"none": 0, "head": 1, "full": 2}


def _bf16(t: torch.Tensor, what: str, numel: int) -> int:
    if not (t.dtype is torch.bfloat16 and t.is_contiguous() and t.numel() == numel and t.device.type == "cpu"):
        raise ValueError(f"{what}: need a contiguous bf16 tensor of {numel} values, got {t.dtype} {list(t.shape)}")
    return t.data_ptr()


class DecodeAttention:
    """The attention of one decode token for a model's GQA layers (not latent attention): the q / k norms, clip,
    rope, the cache writes and the attention itself in one call per layer. Holds the scratch (bf16 q and k after
    rope; float32 scores for max_context positions per head, committed only as far as they are written) and the
    rope tables; `layer` checks a layer's constant arguments once and returns its call."""

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor, *,
                 path: int = BEST):
        """cos / sin: the rope tables, bf16 [max_context, rot] (models/rope.py rope_table); path: the model's
        Compute.path (native/_lib.py)."""
        if _LIB is None:
            raise RuntimeError("DecodeAttention needs the native extension (sluice.quant.native.available())")
        P, rot = cos.shape
        if n_heads % n_kv_heads or rot % 2 or rot > head_dim:
            raise ValueError(f"DecodeAttention: n_heads {n_heads} must be a multiple of n_kv_heads {n_kv_heads} and "
                             f"rot {rot} even and <= head_dim {head_dim}")
        _bf16(cos, "cos", P * rot), _bf16(sin, "sin", P * rot)
        self.nH, self.nKV, self.D, self.rot, self.max_context = n_heads, n_kv_heads, head_dim, rot, P
        self.cos, self.sin, self.path = cos, sin, path
        self.rq = torch.empty((n_heads + n_kv_heads) * head_dim, dtype=torch.bfloat16)
        self.scratch = torch.empty(n_heads * (P + head_dim), dtype=torch.float32)

    def layer(self, ck: torch.Tensor, cv: torch.Tensor, *, norm: str = "none", q_norm: torch.Tensor | None = None,
              k_norm: torch.Tensor | None = None, eps: float = 0.0, clip: float | None = None,
              sinks: torch.Tensor | None = None, zero_centred: bool = False) -> "LayerAttention":
        """The call of one layer whose caches are ck / cv (bf16 [nKV, P >= max_context, D], unit last stride).
        norm "head": q_norm / k_norm bf16 [D]; "full": [nH * D] / [nKV * D]; zero_centred: the norms scale by
        1 + weight in float32 with one rounding (Qwen3-Next, Qwen3.5: models/layers/norm.py Norm), computed here once;
        clip: clamp q, k and v to +-clip; sinks: float32 [nH], the sink logits already rounded to bf16."""
        nH, nKV, D = self.nH, self.nKV, self.D
        if norm not in NORM_MODES:
            raise ValueError(f"DecodeAttention: norm must be one of {sorted(NORM_MODES)}, got {norm!r}")
        mode = NORM_MODES[norm]
        if not (ck.dtype is torch.bfloat16 and cv.dtype is torch.bfloat16 and ck.dim() == 3
                and ck.stride() == cv.stride() and ck.shape == cv.shape and ck.shape[0] == nKV and ck.shape[2] == D
                and ck.stride(2) == 1 and ck.shape[1] >= self.max_context):
            raise ValueError(f"DecodeAttention: need bf16 caches [{nKV}, >= {self.max_context}, {D}] with unit last "
                             f"stride, got {ck.dtype} {list(ck.shape)} stride {ck.stride()}")
        keep = [ck, cv]
        qn = kn = None
        if mode:
            qn = _bf16(q_norm, "q_norm", D if mode == 1 else nH * D)
            kn = _bf16(k_norm, "k_norm", D if mode == 1 else nKV * D)
            if zero_centred:  # the float32 scales the C code applies
                q_norm, k_norm = 1.0 + q_norm.float(), 1.0 + k_norm.float()
                qn, kn = q_norm.data_ptr(), k_norm.data_ptr()
            keep += [q_norm, k_norm]
        if sinks is not None:
            if not (sinks.dtype is torch.float32 and sinks.is_contiguous() and sinks.numel() == nH):
                raise ValueError(f"DecodeAttention: sinks must be float32 [{nH}], got {sinks.dtype} "
                                 f"{list(sinks.shape)}")
            keep.append(sinks)
        return LayerAttention(self, keep, (
            mode, qn, kn, int(zero_centred), eps, -1.0 if clip is None else clip, self.cos.data_ptr(),
            self.sin.data_ptr(), ck.data_ptr(), cv.data_ptr(), ck.stride(0), ck.stride(1)),
            None if sinks is None else sinks.data_ptr())


class LayerAttention:
    """DecodeAttention.layer's result: `(q, k, v, pos, lo) -> out`."""

    def __init__(self, owner: DecodeAttention, keep: list, args: tuple, sinks: int | None):
        self.owner, self._keep, self._args, self._sinks = owner, keep, args, sinks  # _keep: the tensors args point in

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, lo: int,
                 gate: torch.Tensor | None = None) -> torch.Tensor:
        """q [1, nH * D], k / v [1, nKV * D] (bf16; q and k are overwritten with their normed values) -> the
        attention output [1, nH * D] bf16 over cache positions lo..pos, after writing k (normed, rotated) and v at
        pos into the layer's caches. gate (bf16 [1, nH * D], gated attention): the output times sigmoid(gate), each
        rounded to bf16 as torch's `o * torch.sigmoid(gate)` rounds (decode.c gate_bf16)."""
        a = self.owner
        nH, nKV, D = a.nH, a.nKV, a.D
        if not 0 <= lo <= pos < a.max_context:
            raise ValueError(f"DecodeAttention: need 0 <= lo {lo} <= pos {pos} < max_context {a.max_context}")
        out = torch.empty(1, nH * D, dtype=torch.bfloat16)
        _LIB.sluice_attend_bf16(nH, nKV, D, a.rot, _bf16(q, "q", nH * D), _bf16(k, "k", nKV * D),
                                _bf16(v, "v", nKV * D), *self._args, pos, lo, self._sinks, a.rq.data_ptr(),
                                a.scratch.data_ptr(), None if gate is None else _bf16(gate, "gate", nH * D),
                                out.data_ptr(), a.path)
        return out


class AttentionFused:
    """An attention layer's mixer at T = 1 in one native call (layer.c sluice_attention_decode): `(x, pos, lo) -> y`,
    x bf16 [1, H] (the input norm's output), y bf16 [1, H] (o_proj's): q, k, v grouped (`qkv`, q8.LinearsQ8 of
    three), a gated layer's q_proj output parted into queries and gate, the layer's core, and o_proj (`o`, a
    q8.LinearsQ8 of one): each the C call the separate wrappers make on the same values, so the same bits."""

    def __init__(self, layer: LayerAttention, qkv, o, gated: bool, planes: int, path: int):
        a = layer.owner
        nH, nKV, D = a.nH, a.nKV, a.D
        q_rows = (2 if gated else 1) * nH * D
        if qkv.ns != [q_rows, nKV * D, nKV * D] or o.ns[0] != qkv.k or o.k != nH * D or path != a.path:
            raise ValueError(f"AttentionFused: projections {qkv.ns} -> {o.ns} do not fit the layer ({nH} x {D})")
        self.h = qkv.k
        bufs = [torch.empty(1, n, dtype=torch.bfloat16) for n in qkv.ns]  # q_proj's, k, v
        q = torch.empty(1, nH * D, dtype=torch.bfloat16) if gated else bufs[0]
        gate = torch.empty(1, nH * D, dtype=torch.bfloat16)
        self.xf, self.o, self.of = torch.empty(self.h), torch.empty(1, nH * D, dtype=torch.bfloat16), torch.empty(nH * D)
        self.qkv_descs = qkv.fixed(bufs)
        self.out_desc = o.fixed([torch.empty(1, o.ns[0], dtype=torch.bfloat16)])  # its y address set per call
        mode, qn, kn, norm_f32, eps, clip, cos, sin, ck, cv, sh, sp = layer._args
        vals = (nH, nKV, D, a.rot, int(gated), mode, qn or 0, kn or 0, norm_f32, cos, sin, ck, cv, sh, sp,
                layer._sinks or 0, a.rq.data_ptr(), a.scratch.data_ptr(), self.h, ctypes.addressof(self.qkv_descs),
                ctypes.addressof(self.out_desc), planes, path, self.xf.data_ptr(), bufs[0].data_ptr(), q.data_ptr(),
                gate.data_ptr(), self.o.data_ptr(), self.of.data_ptr())
        assert len(vals) == _LIB.sluice_attention_decode_nargs()
        self.p = (ctypes.c_int64 * len(vals))(*vals)
        self.eps, self.clip, self.max_context = float(eps), float(clip), a.max_context
        self._keep = (layer, qkv, o, bufs, q, gate)  # what the addresses point in

    def __call__(self, x: torch.Tensor, pos: int, lo: int) -> torch.Tensor:
        if not (x.dtype is torch.bfloat16 and x.is_contiguous() and x.shape == (1, self.h)):
            raise ValueError(f"AttentionFused: x must be contiguous bf16 [1, {self.h}], got {x.dtype} {list(x.shape)}")
        if not 0 <= lo <= pos < self.max_context:
            raise ValueError(f"AttentionFused: need 0 <= lo {lo} <= pos {pos} < max_context {self.max_context}")
        y = torch.empty(1, self.h, dtype=torch.bfloat16)
        rc = _LIB.sluice_attention_decode(self.p, self.eps, self.clip, x.data_ptr(), pos, lo, y.data_ptr())
        if rc:
            raise MemoryError(f"native attention_decode failed (code {rc}): no memory for its quantized rows")
        return y


def router_probs_bf16(x: torch.Tensor, router: torch.Tensor, *, path: int = BEST) -> torch.Tensor:
    """softmax(F.linear(x, router), dtype=float32) for one bf16 token x [1, H] and a bf16 router [E, H] in one call
    (decode.c): float32 [1, E]. The logits are rounded to bf16 as F.linear's are, but summed in another order, so
    one may land a bf16 step from torch's; equal logits give equal probabilities, so torch.topk over these resolves
    ties as it does over torch's."""
    E, H = router.shape
    probs = torch.empty(1, E, dtype=torch.float32)
    _LIB.sluice_router_probs_bf16(E, H, _bf16(x, "x", H), _bf16(router, "router", E * H), probs.data_ptr(), path)
    return probs


def topk_torch(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """torch.topk(values, k) of one float32 row [n] by topk.cc (the same standard-library calls on the same pairs):
    (values [k] float32, indices [k] int64), or None for k outside 1..n or n over SLUICE_TOPK_MAX (or without the
    extension)."""
    if not (values.dtype is torch.float32 and values.dim() == 1 and values.is_contiguous()):
        raise ValueError(f"topk_torch: need a contiguous float32 row, got {values.dtype} {list(values.shape)}")
    if _TOPK is None or not 1 <= k <= values.numel():
        return None
    ids, out = torch.empty(k, dtype=torch.int64), torch.empty(k, dtype=torch.float32)
    if not _TOPK.sluice_topk_torch(values.numel(), values.data_ptr(), k, ids.data_ptr(), out.data_ptr()):
        return None
    return out, ids


_TIES: list[bool] = []  # ties_exact's answer, once per process


def ties_exact() -> bool:
    """Whether topk.cc picks what torch.topk picks where values tie, on this build against this torch (a C++
    library whose nth_element / partial_sort differ from the one torch was built with would not): 400 rows full of
    ties, each length and k on both of torch's branches (nth_element + sort; partial_sort where k * 64 <= n), the
    indices compared in order. Checked once, ~25 ms; False (or no extension) keeps torch.topk for the ties
    (topk_probs, Guess)."""
    if not _TIES:
        g = torch.Generator().manual_seed(0)
        _TIES.append(_TOPK is not None and all(_tie_row_agrees(i, g) for i in range(400)))
    return _TIES[0]


def _tie_row_agrees(i: int, g: torch.Generator) -> bool:
    """ties_exact's row i (drawn from g): topk.cc's indices equal torch.topk's."""
    n = (2, 8, 9, 64, 128, 160, 256, 512, 1024, 4096)[i % 10]
    k = 1 + int(torch.randint(0, min(n, 64 if i % 3 else 16), (1,), generator=g))
    levels = 1 + int(torch.randint(1, 12, (1,), generator=g))  # few distinct values: ties everywhere
    row = torch.randint(0, levels, (n,), generator=g).float() / levels
    if i % 7 == 0:
        row[int(torch.randint(0, n, (1,), generator=g))] = float("nan")
    got = topk_torch(row, k)
    return got is not None and torch.equal(got[1], torch.topk(row, k).indices)


def topk_probs(probs: torch.Tensor, k: int, norm: bool, dtype: torch.dtype | None, ties: bool | None = None
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """routing.top_of_probs for one token's float32 probabilities [1, E] in one call (decode.c sluice_topk_probs):
    (weights [1, k] in `dtype`, or float32 when None; ids int64 [1, k]), bitwise torch's, ties among the k largest
    or at the k-th resolved as torch.topk resolves them where `ties` (default ties_exact()); None where torch.topk
    has to choose (a NaN; such a tie when not `ties`): the caller then runs top_of_probs."""
    E = probs.shape[1]
    ids = torch.empty(1, k, dtype=torch.int64)
    wf = torch.empty(1, k, dtype=torch.float32)
    bf16 = dtype is torch.bfloat16
    wb = torch.empty(1, k, dtype=torch.bfloat16) if bf16 else None
    ties = ties_exact() if ties is None else ties
    if not _LIB.sluice_topk_probs(E, probs.data_ptr(), k, int(norm), int(bf16), _TOPK_FN if ties else None,
                                  ids.data_ptr(), wf.data_ptr(), None if wb is None else wb.data_ptr()):
        return None
    return (wb if bf16 else wf if dtype in (None, torch.float32) else wf.to(dtype)), ids


class Guess:
    """A decode token's guess of a MoE layer's experts in one native call (decode.c sluice_guess_bf16): the
    zero-centred RMSNorm of x [1, H] bf16 by `scale` [H] float32 (norm.py Norm's scale, on its path `norm_path`), the
    softmax router `router` [E, H] bf16's probabilities of it (on `path`), their k largest. The same bits as
    rms_norm_scaled_bf16, router_probs_bf16 and torch.topk (ties resolved as torch.topk does where `ties`, default
    ties_exact()); its buffers are made once (one guess at a time, on the model's thread)."""

    def __init__(self, scale: torch.Tensor, eps: float, router: torch.Tensor, k: int, path: int = BEST,
                 norm_path: int = BEST, ties: bool | None = None):
        E, H = router.shape
        if not (scale.dtype is torch.float32 and scale.is_contiguous() and scale.numel() == H):
            raise ValueError(f"Guess: scale must be contiguous float32 [{H}], got {scale.dtype} {list(scale.shape)}")
        _bf16(router, "router", E * H)
        if not 1 <= k <= min(64, E):
            raise ValueError(f"Guess: k must be in 1..{min(64, E)}, got {k}")
        self.E, self.H, self.k, self.eps, self.path, self.norm_path = E, H, k, float(eps), path, norm_path
        self.ties = _TOPK_FN if (ties_exact() if ties is None else ties) else None
        self.scale, self.router = scale, router
        self.hb = torch.empty(1, H, dtype=torch.bfloat16)
        self.probs = torch.empty(1, E, dtype=torch.float32)
        self.ids = torch.empty(k, dtype=torch.int64)
        self.wf = torch.empty(k, dtype=torch.float32)
        self._packed: tuple[int, int] | None = None  # packed()'s

    def packed(self) -> tuple[int, int]:
        """(the address of decode.c sluice_guess_packed, of this guess's arguments but x): the call another C library
        makes (store/stream.c's decode layer) with x; its results land where __call__'s do (self.ids, self.probs)."""
        if self._packed is None:
            eps_bits = struct.unpack("<I", struct.pack("<f", self.eps))[0]
            self._args = (ctypes.c_int64 * 14)(
                self.E, self.H, 0, self.scale.data_ptr(), eps_bits, self.norm_path, self.router.data_ptr(), self.k,
                self.ties or 0,
                self.hb.data_ptr(), self.probs.data_ptr(), self.ids.data_ptr(), self.wf.data_ptr(), self.path)
            self._packed = (ctypes.cast(_LIB.sluice_guess_packed, ctypes.c_void_p).value,
                            ctypes.addressof(self._args))
        return self._packed

    def __call__(self, x: torch.Tensor) -> list[int] | torch.Tensor:
        """The k ids (descending probability) for x [1, H] bf16; where torch.topk is to choose (a NaN; ties when not
        self.ties), the probabilities [1, E] float32 instead (a buffer the next call overwrites)."""
        if _LIB.sluice_guess_bf16(self.E, self.H, _bf16(x, "x", self.H), self.scale.data_ptr(), self.eps,
                                  self.norm_path, self.router.data_ptr(), self.k, self.ties, self.hb.data_ptr(),
                                  self.probs.data_ptr(), self.ids.data_ptr(), self.wf.data_ptr(), self.path):
            return self.ids.tolist()
        return self.probs
