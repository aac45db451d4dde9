"""q8.c: the integer path. x quantized to 8-bit codes (one plane: llama.cpp's Q8_0 / Q8_K coding; two: x to
~1/32,000 of a block's max, finer than bf16) and integer dot products (maddubs / madd) against the stored codes of
the GGUF block formats.

    native.q8.q8_supported(spec)              # every GGUF block type sluice reads: the int8 path exists
    xq = q8.quantize_q8(x, spec=spec)         # x float32 [T, in] -> 8-bit codes, uint8 [T, q8_row_bytes(in)]
    y = q8.linear_q8(spec, x, raw)            # y float32 [T, out]
    q, k, v = q8.LinearsQ8([(spec_q, raw_q), ...])(x)   # several projections of one x in one call, rows over the pool
    y = q8.expert_q8(specs, raws, x)          # down(silu(gate x) * up x) in one call, y float32 [T, H]
    call = q8.ExpertCall(specs, offsets); call.many(raw, slots, x, ys, rows)   # a layer's experts, one call

The low-bit types read the same x layouts (super-blocks of 256 values for every 256-value type, 32-value blocks
for IQ4_NL and MXFP4) and are timed per type in benchmarks/results/lowbit/ (benchmarks/lowbit_kernels.py).
A [512 x 1024] Q4_K projection at T=1: 75 -> 45 us of C time, relative L2 ~3e-5 against the exact weights (two
planes); quant/linear.py runs it up to Q8_MAX_ROWS rows and models/layers/experts.py a whole SwiGLU expert as one
expert_q8 call (a Q4_K expert at T=1: 0.48 -> 0.25 ms at 1024 x 512, benchmarks/results/native_kernels.md). The
kernels hold no lock and keep no state; ctypes releases the GIL while they run. LinearsQ8 and ExpertCall.many split
their rows over the C pool, each output element computed as one thread would compute it: any thread count gives the
same bits, and so does every path (`path`, native/_lib.py).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from ..spec import QuantSpec
from ._lib import _GGML, BEST, LIB, buffer, check_x, desc, layout, need, x_out

if LIB is not None:
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    LIB.sluice_quantize_q8.argtypes = [i64, ptr, i64, ptr, i32, i32]  # K, x, T, xq, planes, path
    LIB.sluice_quantize_q8.restype = None
    LIB.sluice_linear_q8.argtypes = [i32, i64, i64, ptr, i64, ptr, ptr, i64, i32, ptr, i64, i64, i32]  # xq, x, T, ..
    LIB.sluice_linear_q8.restype = i32
    LIB.sluice_expert_q8.argtypes = [i32, ptr, i64] * 3 + [i64, i64, ptr, i64, i32, ptr, i32]  # H, I, x, T, P, y
    LIB.sluice_expert_q8.restype = i32
    LIB.sluice_linears_q8.argtypes = [i64, ptr, i64, ptr, i64, i32, i32]  # m, descs, K, x, T, planes, path
    LIB.sluice_experts_q8.argtypes = [i64, ptr, i64, i64, ptr, i64, i32, i32]  # n, experts, H, I, x, T, P, path
    LIB.sluice_linears_q8.restype = LIB.sluice_experts_q8.restype = i32
    LIB.sluice_q8_layout.argtypes = [i32, i32]
    LIB.sluice_q8_layout.restype = i32
    LIB.sluice_q8_row_bytes.argtypes = [i64, i32]
    LIB.sluice_q8_row_bytes.restype = i64
    LIB.sluice_set_super_blocks.argtypes = [i32]
    LIB.sluice_set_super_blocks.restype = None
    LIB.sluice_set_prefetch.argtypes = [i64]
    LIB.sluice_set_prefetch.restype = None
    LIB.sluice_set_task_spread.argtypes = [i64]
    LIB.sluice_set_task_spread.restype = None


def q8_supported(spec: QuantSpec) -> bool:
    """Whether the int8-activation path (linear_q8) computes this format: the GGUF block types, Q4_0 - Q6_K in q8.c,
    MXFP4 and the low-bit types (Q2_K, Q3_K, TQ1_0, TQ2_0, IQ1_S - IQ4_XS) in q8_low.c; not plain or MLX weights."""
    return spec.family == "ggml" and spec.name in _GGML


#: planes of 8-bit activation codes a call uses when it names none (a model names its own: Compute.planes, from
#: LoadOptions.activations). 1 is llama.cpp's scheme (x rounded to 1/127 of each 32-block's max, of each 256-block's
#: for the K-quants as its Q8_K does): faster, but it took the tiny random Q5_K model of
#: tests/quant/test_gguf_models.py to 6.6e-2 relative L2 of the logits at the default dtype (float kernel 3.1e-2,
#: transformers' own bf16 run 4.4e-2: the model amplifies small errors) and a random expert's output up to 2.5e-2
#: off the exact weights' (tests/quant/test_q8.py). 2 adds the residual in 1/256ths (x to
#: ~1/32,000 of the block max, finer than bf16): the same logits as the float kernel to bf16 rounding.
DEFAULT_PLANES = 2


def q8_row_bytes(in_features: int, planes: int = DEFAULT_PLANES, spec: QuantSpec | None = None) -> int:
    """Bytes of one quantized x row in the layout `spec`'s rows read (q8.c sluice_q8_row_bytes): per 32 values
    float d, float d * sum, `planes` x 32 int8 codes; the K-quants: per 256 values float d, 16 int32 sums, `planes`
    planes of 256 codes. spec None: the 32-value layout."""
    return LIB.sluice_q8_row_bytes(in_features, _layout_of(spec, _planes(planes)))


def set_super_blocks(on: bool) -> None:
    """Benchmark hook: False makes the K-quants read x in 32-value blocks, as before the super-block layout (q8.c),
    process-wide, until set back (`benchmarks/knobs.py layouts`). Default True."""
    LIB.sluice_set_super_blocks(int(on))


def set_prefetch(nbytes: int) -> None:
    """Benchmark hook: how far ahead (bytes) the integer path's row loop prefetches a task's weight rows (q8.c),
    process-wide; 0 turns it off. Default 2048."""
    LIB.sluice_set_prefetch(int(nbytes))


def set_task_spread(spread: int) -> None:
    """Benchmark hook: the tasks per thread a job's rows are cut into when the job is large enough (q8.c task_rows:
    never below 64K weights a task), process-wide; a huge value gives 64K-weight tasks (as before). Default 4."""
    LIB.sluice_set_task_spread(int(spread))


def _layout_of(spec: QuantSpec | None, planes: int) -> int:
    """The C x layout (XF) spec's rows read with `planes`: 1 or 2 (32-value blocks), 3 (super-blocks)."""
    if spec is None:
        return planes
    return LIB.sluice_q8_layout(layout(spec)[1], planes)


def _planes(planes: int) -> int:
    """planes, checked (1 or 2)."""
    if planes not in (1, 2):
        raise ValueError(f"planes must be 1 or 2, got {planes}")
    return planes


def quantize_q8(x: torch.Tensor, planes: int = DEFAULT_PLANES, out: torch.Tensor | None = None,
                spec: QuantSpec | None = None, *, path: int = BEST) -> torch.Tensor:
    """x float32 [T, in] (contiguous, in a multiple of 32) -> its 8-bit codes, uint8 [T, q8_row_bytes(in, planes,
    spec)] (into out when given), in the layout the rows of `spec` read (None: the 32-value blocks every format
    but the two-plane K-quants reads). linear_q8(spec, x, raw, xq=...) takes it."""
    need()
    k = x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() == 2 else 0
    if k == 0 or k % 32:
        raise ValueError(f"x must be [T, in] with in a positive multiple of 32, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    x = check_x(x, k)
    planes = _planes(planes)
    rb = q8_row_bytes(k, planes, spec)
    if out is None:
        out = torch.empty(x.shape[0], rb, dtype=torch.uint8)
    buffer(out, f"xq ([{x.shape[0]}, {rb}])", torch.uint8, x.shape[0] * rb)
    LIB.sluice_quantize_q8(k, x.data_ptr(), x.shape[0], out.data_ptr(), _layout_of(spec, planes), path)
    return out.view(x.shape[0], rb)


def linear_q8(spec: QuantSpec, x: torch.Tensor, raw: torch.Tensor, out: torch.Tensor | None = None,
              xq: torch.Tensor | None = None, planes: int = DEFAULT_PLANES, *, path: int = BEST) -> torch.Tensor:
    """y [T, out] (float32) = x [T, in] @ W^T on the integer path: x quantized to `planes` planes of 8-bit codes (or
    xq, quantize_q8's result for this x and planes, reused), integer dot products against the stored codes.
    Deterministic, the same bits on the AVX2 and the scalar path and for any T. Relative L2 against the exact
    weights (tests/quant/test_q8.py): planes=1 5e-3 - 1.1e-2, planes=2 2e-5 - 4e-5."""
    d, x, out = _q8_args(spec, x, raw, out)
    if xq is not None:
        buffer(xq, "xq", torch.uint8, x.shape[0] * q8_row_bytes(spec.in_features, planes, spec))
    return _run_q8(d, xq, x, out, _planes(planes), (0, spec.out_features), path)


def _q8_args(spec: QuantSpec, x: torch.Tensor, raw: torch.Tensor, out: torch.Tensor | None) -> tuple:
    """(format, N, K, codes address, bytes per row), x and out of one linear_q8 call, checked."""
    if not q8_supported(spec):
        raise ValueError(f"the int8 path does not compute {spec.family} {spec.name} (see q8.q8_supported)")
    return (desc(spec, raw)[:5], *x_out(x, out, spec.out_features, spec.in_features))


def _run_q8(d: tuple, xq: torch.Tensor | None, x: torch.Tensor, out: torch.Tensor, planes: int,
            rows: tuple[int, int], path: int) -> torch.Tensor:
    """Output columns rows=(n0, n1) of the integer path (x quantized here when xq is None)."""
    rc = LIB.sluice_linear_q8(*d, None if xq is None else xq.data_ptr(), x.data_ptr(), x.shape[0], planes,
                               out.data_ptr(), rows[0], rows[1], path)
    if rc:
        raise MemoryError(f"native linear_q8 failed (code {rc}): no memory for {x.shape[0]} quantized rows")
    return out


class LinearsQ8:
    """Several projections of one x on the integer path in one native call, their output rows split over the
    threads of set_threads (a layer's q, k and v; one large head): `call(x)` -> [y_a [T, out_a]] for x float32
    [T, in] contiguous, float32 or (out_dtype=torch.bfloat16) the float32 result rounded to bf16 in the C call, as
    .to(torch.bfloat16) rounds it. x is quantized once; each y element is linear_q8's, whichever thread computes
    it."""

    def __init__(self, pairs: list[tuple[QuantSpec, torch.Tensor]]):
        if not 1 <= len(pairs) <= 16:
            raise ValueError(f"LinearsQ8 takes 1 to 16 projections, got {len(pairs)}")
        ks = {spec.in_features for spec, _ in pairs}
        if len(ks) != 1:
            raise ValueError(f"LinearsQ8's projections must share in_features, got {sorted(ks)}")
        self.k = ks.pop()
        self.raws = [raw for _, raw in pairs]  # the C call reads their bytes: kept alive
        self.descs = [_q8_args(spec, torch.empty(0, self.k), raw, None)[0] for spec, raw in pairs]
        self.ns = [spec.out_features for spec, _ in pairs]
        self._arr = ctypes.c_int64 * (6 * len(pairs))

    def __call__(self, x: torch.Tensor, planes: int = DEFAULT_PLANES, out_dtype: torch.dtype = torch.float32, *,
                 path: int = BEST) -> list[torch.Tensor]:
        x = check_x(x, self.k)
        if out_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"LinearsQ8 writes float32 or bfloat16, got {out_dtype}")
        t, bf16 = x.shape[0], int(out_dtype is torch.bfloat16)
        ys, vals = [], []
        for (fmt, n, _, q, row_bytes), ni in zip(self.descs, self.ns):
            y = torch.empty(t, ni, dtype=out_dtype)  # one op each (views of one block took two more each)
            ys.append(y)
            vals += (fmt, n, q, row_bytes, y.data_ptr(), bf16)
        rc = LIB.sluice_linears_q8(len(self.ns), self._arr(*vals), self.k, x.data_ptr(), t, _planes(planes), path)
        if rc:
            raise MemoryError(f"native linears_q8 failed (code {rc}): no memory for {t} quantized rows")
        return ys

    def fixed(self, outs: list[torch.Tensor]) -> ctypes.Array:
        """The C call's descriptors (6 int64 each: format, N, codes address, bytes per row, y address, bf16) of
        these projections writing bf16 into `outs` (contiguous bf16 [1, N_a] each, kept alive by the caller), for a
        C caller that runs sluice_linears_q8 itself on one row (native/layer.c): what __call__ passes at T = 1 and
        out_dtype bf16, so the same bits."""
        if len(outs) != len(self.ns) or not all(o.dtype is torch.bfloat16 and o.is_contiguous() and o.numel() == n
                                                for o, n in zip(outs, self.ns)):
            raise ValueError(f"LinearsQ8.fixed: need contiguous bf16 outputs of {self.ns} values")
        vals = []
        for (fmt, n, _, q, row_bytes), o in zip(self.descs, outs):
            vals += (fmt, n, q, row_bytes, o.data_ptr(), 1)
        return (ctypes.c_int64 * len(vals))(*vals)


@functools.lru_cache(maxsize=1024)
def _expert_layout(specs: tuple) -> tuple:
    """(H, I, ((C format, codes offset, bytes per row, stored bytes) for gate, up, down)), checked once per specs."""
    gate, up, down = specs
    if not all(q8_supported(s) for s in specs):
        raise ValueError("the int8 path does not compute " + ", ".join(f"{s.family} {s.name}" for s in specs))
    h, i = gate.in_features, gate.out_features
    if (up.in_features, up.out_features, down.in_features, down.out_features) != (h, i, i, h):
        raise ValueError(f"expert shapes must be gate/up [I, H] and down [H, I], got {gate.out_features}x"
                         f"{gate.in_features}, {up.out_features}x{up.in_features}, {down.out_features}x"
                         f"{down.in_features}")
    return h, i, tuple((lay[1], lay[4], lay[5], lay[0]) for lay in map(layout, specs))


def expert_q8(specs: tuple, raws: tuple, x: torch.Tensor, out: torch.Tensor | None = None,
              planes: int = DEFAULT_PLANES, *, path: int = BEST) -> torch.Tensor:
    """One SwiGLU expert on the integer path in one native call: y [T, H] float32 = down(silu(gate x) * up x), specs
    (gate [I, H], up [I, H], down [H, I]) QuantSpecs of formats q8_supported, raws their stored bytes, x float32
    [T, H]. x is quantized once for gate and up; silu(g) * u is computed in float32 and quantized once for down.
    The same bits on both C paths and for any T; gate / up / down each as linear_q8 computes them.
    The checks that depend on specs only run once per specs (~35 -> ~15 us of Python per call)."""
    h, i, args = expert_args(specs, raws)
    return run_expert_args(args, h, i, x, out, planes, path=path)


def expert_args(specs: tuple, raws: tuple) -> tuple[int, int, tuple]:
    """(H, I, the C call's (format, codes address, bytes per row) of gate, up, down) of one SwiGLU expert stored as
    three tensors (expert_q8's specs and raws, checked as it checks them): what ExpertCall.many takes as `extra`, a
    layer's shared expert computed in its routed experts' call. The addresses stay valid while raws live."""
    h, i, parts = _expert_layout(tuple(specs))
    args = []
    for (fmt, at, row_bytes, nbytes), spec, raw in zip(parts, specs, raws):
        if not (type(raw) is torch.Tensor and raw.dtype is torch.uint8 and raw.dim() == 1 and raw.numel() == nbytes
                and raw.is_cpu and raw.is_contiguous()):
            desc(spec, raw)  # raises, naming what is wrong
        args += (fmt, raw.data_ptr() + at, row_bytes)
    return h, i, tuple(args)


def run_expert_args(args: tuple, h: int, i: int, x: torch.Tensor, out: torch.Tensor, planes: int = DEFAULT_PLANES,
                    *, path: int = BEST) -> torch.Tensor:
    """expert_q8 on an expert_args expert (x float32 [T, H] contiguous, out float32 [T, H]): the same C call."""
    x, out = x_out(x, out, h, h)
    return _run_expert(args, h, i, x, out, planes, path)


def _run_expert(args: tuple | list, h: int, i: int, x: torch.Tensor, out: torch.Tensor, planes: int,
                path: int) -> torch.Tensor:
    """The C call behind expert_q8 and ExpertCall: args (format, codes address, bytes per row) of gate, up, down."""
    rc = LIB.sluice_expert_q8(*args, h, i, x.data_ptr(), x.shape[0], _planes(planes), out.data_ptr(), path)
    if rc:
        raise MemoryError(f"native expert failed (code {rc}): no memory for its [{x.shape[0]} x {i}] scratch")
    return out


class ExpertCall:
    """expert_q8 for experts of one stored layout, every check that depends on the layout done once: `call(slot, x,
    out)` with slot the expert's uint8 bytes (gate, up, down at `offsets`), x float32 [T, H], out float32 [T, H].
    The decode loop calls it ~130 times per token: expert_q8's per-call Python (spec hashing, three slices, the
    output tensor) was ~0.1 ms of the ~0.34 ms one expert took in the model (peers Q4_K_M, resident, quiet); this
    is a few us. The same C call, so the same bits as expert_q8."""

    def __init__(self, specs: tuple, offsets: tuple[int, int, int]):
        self.h, self.i, parts = _expert_layout(tuple(specs))
        self.parts = tuple((fmt, off + at, row_bytes) for (fmt, at, row_bytes, _), off in zip(parts, offsets))
        self.nbytes = max(off + nbytes for (_, _, _, nbytes), off in zip(parts, offsets))

    def __call__(self, slot: torch.Tensor, x: torch.Tensor, out: torch.Tensor, planes: int = DEFAULT_PLANES, *,
                 path: int = BEST) -> None:
        h = self.h
        if not (slot.dtype is torch.uint8 and slot.is_contiguous() and slot.numel() >= self.nbytes):
            raise ValueError(f"expert slot: need >= {self.nbytes} contiguous uint8 bytes, got {slot.dtype} "
                             f"{list(slot.shape)}")
        if not (x.dtype is torch.float32 and x.dim() == 2 and x.shape[1] == h and x.is_contiguous()
                and out.dtype is torch.float32 and out.shape == x.shape and out.is_contiguous()):
            raise ValueError(f"expert x / out: need contiguous float32 [T, {h}], got {x.dtype} {list(x.shape)} / "
                             f"{out.dtype} {list(out.shape)}")
        base = slot.data_ptr()
        (gf, ga, gr), (uf, ua, ur), (df, da, dr) = self.parts
        _run_expert((gf, base + ga, gr, uf, base + ua, ur, df, base + da, dr), h, self.i, x, out, planes, path)

    def many(self, raw: torch.Tensor, slots: list[int], x: torch.Tensor, ys: torch.Tensor, rows: list[int],
             planes: int = DEFAULT_PLANES, *, path: int = BEST, extra: tuple | None = None) -> None:
        """The experts in rows `slots` of raw (uint8 [S, >= nbytes], one expert per row, rows contiguous) on the
        same x float32 [T, H], expert e into ys[rows[e]] (ys float32 [R, T, H], or [R, H] when T == 1), in one
        native call, the rows of all their projections split over the threads of set_threads (q8.c
        sluice_experts_q8): each output is bitwise what call(raw[slots[e]], x, ys[rows[e]]) writes, whatever the
        thread count. Addresses instead of
        slices: a slice is a torch op (~3 us), and a decode layer passes 8 experts. `extra`: (expert_args of one
        more expert of the same H and I, its row of ys), computed in the same call (a layer's shared expert): bitwise
        what run_expert_args writes for it."""
        h, n = self.h, len(slots)
        if not (x.dtype is torch.float32 and x.dim() == 2 and x.shape[1] == h and x.is_contiguous()):
            raise ValueError(f"expert x: need contiguous float32 [T, {h}], got {x.dtype} {list(x.shape)}")
        th = x.numel()
        if not (raw.dtype is torch.uint8 and raw.dim() == 2 and raw.stride(1) == 1 and raw.shape[1] >= self.nbytes
                and raw.stride(0) >= raw.shape[1] and all(0 <= s < raw.shape[0] for s in slots)):
            raise ValueError(f"expert slots: need rows < {raw.shape[0] if raw.dim() == 2 else '?'} of uint8 "
                             f"[S, >= {self.nbytes}], each row contiguous, got {raw.dtype} {list(raw.shape)} and rows "
                             f"{slots}")
        r_max = ys.numel() // th if th else 0
        if not (ys.dtype is torch.float32 and ys.is_contiguous() and th and ys.numel() == r_max * th
                and ys.shape[-1] == h and len(rows) == n and all(0 <= r < r_max for r in rows)):
            raise ValueError(f"expert outputs: need contiguous float32 [R, {list(x.shape)}] and {n} rows < R, got "
                             f"{ys.dtype} {list(ys.shape)} and rows {rows}")
        (gf, ga, gr), (uf, ua, ur), (df, da, dr) = self.parts
        vals, base, stride, yb = [], raw.data_ptr(), raw.stride(0), ys.data_ptr()
        for s, r in zip(slots, rows):
            at = base + s * stride
            vals += (gf, at + ga, gr, uf, at + ua, ur, df, at + da, dr, yb + 4 * r * th)
        if extra is not None:
            args, r = extra
            if not (len(args) == 9 and 0 <= r < r_max):
                raise ValueError(f"extra expert: need 9 call values and a row < {r_max}, got {len(args)} and {r}")
            vals += (*args, yb + 4 * r * th)
            n += 1
        if not n:
            return
        rc = LIB.sluice_experts_q8(n, (ctypes.c_int64 * len(vals))(*vals), h, self.i, x.data_ptr(), x.shape[0],
                                    _planes(planes), path)
        if rc:
            raise MemoryError(f"native experts failed (code {rc}): no memory for {n} experts' [{x.shape[0]} x "
                              f"{self.i}] scratch")
