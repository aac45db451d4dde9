"""A prompt's Q4_K projections on 8-bit activations (prompt.c): the int8 prompt path of LoadOptions.activations
"int8" where the CPU has AVX512-VNNI.

    from sluice.quant.native import prompt
    prompt.available()                         # the extension is built and this CPU has AVX512-VNNI
    prompt.avx2()                              # ... and AVX2 (prompt_avx2.c; Compute.prompt_planes decides whether a
                                               # model takes these kernels, and at how many planes)
    prompt.supported(spec)                     # a Q4_K projection whose in_features is a multiple of 256
    prompt.linears([(spec, raw, out), ...], x) # out_a float32 [T, N_a] (views with a row stride allowed) = x @ W_a^T
    prompt.expert((gate, raw), (up, raw), (down, raw), x, out)   # out bf16 [T, H] = down(silu(gate x) * up x)
    prompt.expert((gate_up, raw), None, None, x, h)              # h bf16 [T, I] = silu(gate x) * up x
    coded = prompt.code(x)                     # a layer's rows coded once: prompt.expert(..., coded, out, rows=idx)
    prompt.to_bf16(y)                          # y float32 [T, N] -> bf16, torch's bits, rows over the pool

x (float32 or bf16 [T, K]) is coded once per call as llama.cpp's Q8_K codes it (8 bits per value, one scale per 256
values: to 1/127 of each 256-block's largest value), the products summed in integers per 32-value sub-block and
scaled in float32 in a fixed order, so every output element has the same bits whichever thread ran it, whatever T
and on the portable path too. Against a bf16 GEMM on the dequantized weights it trades precision
(0.5-1% relative error per projection instead of ~0.2%) for time: one peers expert's [256 x 1024] @ [1024 x 1024]
gate / up 0.450 ms against 0.718 to dequantize and multiply in bf16 (0.612 for the GEMM alone), its [256 x 512] @
[512 x 1024] down 0.230 against 0.379 (`.venv/bin/python benchmarks/prefill/knobs.py gemm`, 2 threads). Q6_K (a
Q4_K_M file's other format) was tried the same way and dropped: no faster than its bf16 GEMM inside the model.

Where a prompt's GEMMs are float32 (no bf16 dot products: AVX2 CPUs, or --isa avx2; Compute.prompt_planes) the AVX2
tiles (prompt_avx2.c; Q6_K in prompt_q6k.c) run at either coding: planes=2 (activations int16) adds a second plane,
lo = rint((x / D - code) * 256), whose integer sums are scaled by D / 256 (x to ~1/32,000 of each block's max,
relative error ~3e-5 a projection). Against what such a CPU ran before, dequantizing to float32 for torch's float32
GEMM, 256 rows, 2 threads, Intel Xeon (Sapphire Rapids VM) with sluice, torch and MKL capped at AVX2
(`MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python
benchmarks/prefill/knobs.py tiles`), ms int16 / int8 / float32: Q4_K [256 x 1024] @ [1024 x 512] 1.71 / 1.00 / 1.79,
[256 x 512] @ [512 x 1024] 1.62 / 0.89 / 2.59; Q6_K [256 x 512] @ [512 x 1024] 1.94 / 1.01 / 1.80; one peers expert
(expert(), Q4_K down) 4.91 / 2.78 against 6.37 for its three projections in turn. int16 takes two maddubs per weight
and 8-bit code where the float32 GEMM takes one FMA lane: ~1.3x is its ceiling on AVX2; int8 (llama.cpp's coding)
~2.3x.
"""

from __future__ import annotations

import ctypes

import torch

from ..spec import QuantSpec
from ._lib import BEST, LIB as _LIB, desc as _desc, layout as _layout, need, simd

if _LIB is not None:
    _LIB.sluice_prompt_vnni.restype = ctypes.c_int
    _LIB.sluice_prompt_linears.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                           ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    _LIB.sluice_prompt_linears.restype = ctypes.c_int  # m, descs, K, x, bf16, T, planes, path
    _i64, _ptr = ctypes.c_int64, ctypes.c_void_p
    # gate (codes, bytes per row), up, their format, down, its format, H, I, x, T, y, h, planes, path
    _LIB.sluice_prompt_expert.argtypes = [_ptr, _i64] * 2 + [ctypes.c_int, _ptr, _i64, ctypes.c_int, _i64, _i64, _ptr,
                                                             _i64, _ptr, _ptr, ctypes.c_int, ctypes.c_int]
    _LIB.sluice_prompt_expert.restype = ctypes.c_int
    # the same with a layer's coded rows: ..., x, coded rows, their count, row indices, T, y, h, planes, path
    _LIB.sluice_prompt_expert_coded.argtypes = ([_ptr, _i64] * 2 + [ctypes.c_int, _ptr, _i64, ctypes.c_int, _i64, _i64,
                                                                    _ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr,
                                                                    ctypes.c_int, ctypes.c_int])
    _LIB.sluice_prompt_expert_coded.restype = ctypes.c_int
    _LIB.sluice_prompt_code.argtypes = [_ptr, _i64, _i64, _ptr, ctypes.c_int, ctypes.c_int]  # x, T, K, out, P, path
    _LIB.sluice_prompt_code.restype = ctypes.c_int
    _LIB.sluice_prompt_code_bytes.argtypes = [_i64, _i64, ctypes.c_int]
    _LIB.sluice_prompt_code_bytes.restype = _i64
    # n, expert addresses, first rows, row counts, gate bytes per row, up offset, its bytes per row, gate format,
    # down offset, its bytes per row, its format, H, I, coded rows, their count, row indices, their count, y, planes,
    # path
    _LIB.sluice_prompt_experts_coded.argtypes = [_i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_int, _i64, _i64,
                                                 ctypes.c_int, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, ctypes.c_int,
                                                 ctypes.c_int]
    _LIB.sluice_prompt_experts_coded.restype = ctypes.c_int
    _LIB.sluice_prompt_bf16.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64, ctypes.c_int]  # y, T, N, ldy, out, ldo
    _LIB.sluice_prompt_bf16.restype = None


def available() -> bool:
    """Whether the int8 prompt kernel runs at speed here: the extension is built and the CPU has AVX512-VNNI (else
    only its portable path exists, for tests: far slower than the bf16 GEMM it would replace)."""
    return _LIB is not None and bool(_LIB.sluice_prompt_vnni())


def avx2() -> bool:
    """Whether prompt.c's AVX2 tiles (prompt_avx2.c) run here: the extension is built and the CPU has AVX2 + FMA +
    F16C."""
    return _LIB is not None and simd()


#: the formats each kind of tiles computes: the VNNI tiles Q4_K (Q6_K was tried and dropped there: below), the AVX2
#: and portable tiles Q4_K, Q5_K and Q6_K (Compute.prompt_formats says which a model's prompt takes)
VNNI_FORMATS, AVX2_FORMATS = frozenset({"Q4_K"}), frozenset({"Q4_K", "Q5_K", "Q6_K"})


def supported(spec: QuantSpec, formats: frozenset = VNNI_FORMATS) -> bool:
    """Whether prompt.c computes this projection among `formats`: a GGUF type of them with in_features a multiple of
    256."""
    return spec.family == "ggml" and spec.name in formats and spec.in_features % 256 == 0


def linears(projections: list[tuple[QuantSpec, torch.Tensor, torch.Tensor]], x: torch.Tensor, *,
            planes: int = 1, path: int = BEST) -> None:
    """out = x @ W^T for each (spec, raw, out) of up to 4 Q4_K, Q5_K or Q6_K projections (Q5_K / Q6_K always on the
    AVX2 or portable tiles) sharing x [T, K] (float32 or bf16, contiguous): raw the stored bytes, out float32 [T, N] with unit column stride (a column slice of a wider
    output is fine). x is coded once, at `planes` (1 or 2) planes of 8-bit codes; the tiles of all projections run
    over the native pool."""
    need()
    _check_planes(planes)
    if not 1 <= len(projections) <= 4:
        raise ValueError(f"prompt.linears takes 1 to 4 projections, got {len(projections)}")
    if not (isinstance(x, torch.Tensor) and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2
            and x.is_cpu and x.is_contiguous()):
        got = f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a contiguous CPU float32 or bf16 [T, K] tensor, got {got}")
    t, k = x.shape
    vals: list[int] = []
    for spec, raw, out in projections:
        if not supported(spec, AVX2_FORMATS):
            raise ValueError(f"prompt.linears computes Q4_K, Q5_K and Q6_K with in_features a multiple of 256, got "
                             f"{spec.name} [{spec.out_features}, {spec.in_features}]")
        if spec.in_features != k:
            raise ValueError(f"x has {k} columns, {spec.name} [{spec.out_features}, {spec.in_features}] needs "
                             f"{spec.in_features}")
        if not (isinstance(out, torch.Tensor) and out.dtype is torch.float32 and out.is_cpu and out.dim() == 2
                and tuple(out.shape) == (t, spec.out_features) and out.stride(1) == 1
                and out.stride(0) >= spec.out_features):
            got = f"{out.dtype} {list(out.shape)} strides {out.stride()}" if isinstance(out, torch.Tensor) else out
            raise ValueError(f"out must be float32 [{t}, {spec.out_features}] with unit column stride, got {got}")
        fmt, n, _, q, row_bytes, *_ = _desc(spec, raw)
        vals += (fmt, n, q, row_bytes, out.data_ptr(), out.stride(0))
    rc = _LIB.sluice_prompt_linears(len(projections), (ctypes.c_int64 * len(vals))(*vals), k, x.data_ptr(),
                                int(x.dtype is torch.bfloat16), t, planes, path)
    if rc == -1:
        raise MemoryError(f"prompt.linears: no memory for the packed weights and the [{t} x {k}] codes")
    if rc:
        raise ValueError(f"prompt.linears: the kernel refused its arguments (code {rc})")


def _codes(spec: QuantSpec, raw: torch.Tensor, n: int, k: int, what: str,
           formats: frozenset = VNNI_FORMATS) -> tuple[int, int, int]:
    """(codes address, bytes per row, C format) of a projection [n, k] of `formats`, checked."""
    if not supported(spec, formats) or (spec.out_features, spec.in_features) != (n, k):
        raise ValueError(f"prompt.expert: {what} must be {' or '.join(sorted(formats))} [{n}, {k}], got {spec.name} "
                         f"[{spec.out_features}, {spec.in_features}]")
    fmt, _, _, q, row_bytes, *_ = _desc(spec, raw)
    return q, row_bytes, fmt


def _check_planes(planes: int) -> None:
    if planes not in (1, 2):
        raise ValueError(f"planes must be 1 (int8 activations) or 2 (int16), got {planes}")


class Coded:
    """A [T, K] bf16 x coded once (code()) at `planes` planes: the bytes prompt.c reads, for experts that each take
    some of its rows (at the same planes)."""

    def __init__(self, data: torch.Tensor, rows: int, cols: int, planes: int):
        self.data, self.rows, self.cols, self.planes = data, rows, cols, planes


class ExpertsCall:
    """prompt.expert for many experts of one slot layout in one native call: each expert's gate, up (or None: gate
    is [gate; up]) and down (Q4_K, Q5_K or Q6_K gate / up; Q4_K or Q6_K down) at byte offsets of its slot, checked
    once here; run(slots, x, rows, starts, counts, out) computes expert e on rows rows[starts[e] : + counts[e]] of
    the Coded x into out[starts[e] : + counts[e]] (bf16 [n_rows, H]), bitwise prompt.expert on each in turn."""

    def __init__(self, gate: QuantSpec, up: QuantSpec | None, down: QuantSpec, offsets: tuple[int, int, int]):
        need()
        self.h, self.i = gate.in_features, gate.out_features // (1 if up is not None else 2)
        for spec, n, k, what in ((gate, gate.out_features, self.h, "gate"), (up, self.i, self.h, "up"),
                                 (down, self.h, self.i, "down")):
            if spec is not None and (not supported(spec, AVX2_FORMATS) or (spec.out_features, spec.in_features)
                                     != (n, k)):
                raise ValueError(f"prompt.ExpertsCall: {what} must be {' or '.join(sorted(AVX2_FORMATS))} [{n}, {k}]"
                                 f", got {spec.name} [{spec.out_features}, {spec.in_features}]")
        if up is not None and up.name != gate.name:
            raise ValueError(f"prompt.ExpertsCall: gate and up must share a format, got {gate.name} and {up.name}")
        (_, self.gfmt, _, _, _, self.grb, *_), (_, self.dfmt, _, _, _, self.drb, *_) = _layout(gate), _layout(down)
        self.urb = self.grb if up is not None else 0
        self.uo, self.dof = (offsets[1] if up is not None else -1), offsets[2]
        self.end = offsets[2] + down.nbytes  # a slot holds at least this many bytes

    def run(self, raw: torch.Tensor, slots: list[int], x: Coded, rows: torch.Tensor, starts: list[int],
            counts: list[int], out: torch.Tensor, *, path: int = BEST) -> None:
        """raw: uint8 [S, slot bytes] (the store's slots); slots[e] expert e's; rows int64 [n_rows] (row indices
        into x), out bf16 [n_rows, H], both contiguous."""
        n = len(slots)
        if not (isinstance(raw, torch.Tensor) and raw.dtype is torch.uint8 and raw.dim() == 2 and raw.is_cpu
                and raw.stride(1) == 1 and raw.shape[1] >= self.end):
            raise ValueError(f"prompt.ExpertsCall: raw must be CPU uint8 [slots, bytes], got {raw}")
        if not (isinstance(x, Coded) and x.cols == self.h and rows.dtype is torch.int64 and rows.dim() == 1
                and rows.is_contiguous() and out.dtype is torch.bfloat16 and out.is_contiguous()
                and tuple(out.shape) == (rows.numel(), self.h) and len(starts) == len(counts) == n):
            raise ValueError(f"prompt.ExpertsCall: x must be a Coded [T, {self.h}], rows int64 [n], out bf16 [n, "
                             f"{self.h}] and a start and count per slot")
        base, step = raw.data_ptr(), raw.stride(0)
        if not all(0 <= s < raw.shape[0] for s in slots):
            raise ValueError(f"prompt.ExpertsCall: slots {slots} outside the {raw.shape[0]} slots")
        arr = ctypes.c_int64 * n
        rc = _LIB.sluice_prompt_experts_coded(
            n, arr(*(base + s * step for s in slots)), arr(*starts), arr(*counts), self.grb, self.uo, self.urb,
            self.gfmt, self.dof, self.drb, self.dfmt, self.h, self.i, x.data.data_ptr(), x.rows, rows.data_ptr(),
            rows.numel(), out.data_ptr(), x.planes, path)
        if rc == -1:
            raise MemoryError(f"prompt.ExpertsCall: no memory for an expert's scratch ({max(counts)} rows)")
        if rc:
            raise ValueError(f"prompt.ExpertsCall: the kernel refused its arguments (code {rc})")


def to_bf16(y: torch.Tensor, *, path: int = BEST) -> torch.Tensor:
    """y float32 [T, N] (unit column stride; a column slice of a wider output is fine) rounded to a new contiguous
    bf16 [T, N], bitwise torch's y.to(torch.bfloat16), the rows over the native pool."""
    need()
    if not (isinstance(y, torch.Tensor) and y.dtype is torch.float32 and y.dim() == 2 and y.is_cpu
            and y.stride(1) == 1 and y.stride(0) >= y.shape[1]):
        got = f"{y.dtype} {list(y.shape)} strides {y.stride()}" if isinstance(y, torch.Tensor) else type(y).__name__
        raise ValueError(f"prompt.to_bf16: y must be a CPU float32 [T, N] tensor with unit column stride, got {got}")
    out = torch.empty(y.shape, dtype=torch.bfloat16)
    _LIB.sluice_prompt_bf16(y.data_ptr(), y.shape[0], y.shape[1], y.stride(0), out.data_ptr(), y.shape[1], path)
    return out


def code(x: torch.Tensor, *, planes: int = 1, path: int = BEST) -> Coded:
    """x bf16 [T, K] (contiguous, K a multiple of 256) coded as every call here codes its x, once: each row's bytes
    are those coding the row alone gives, so an expert on some of these rows (expert(..., rows=)) computes the same
    bits as on those rows of x."""
    need()
    _check_planes(planes)
    if not (isinstance(x, torch.Tensor) and x.dtype is torch.bfloat16 and x.dim() == 2 and x.is_cpu
            and x.is_contiguous() and x.shape[1] % 256 == 0):
        got = f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"prompt.code: x must be a contiguous CPU bf16 [T, K] tensor, K a multiple of 256, got {got}")
    t, k = x.shape
    data = torch.empty(_LIB.sluice_prompt_code_bytes(t, k, planes), dtype=torch.uint8)
    if _LIB.sluice_prompt_code(x.data_ptr(), t, k, data.data_ptr(), planes, path):
        raise ValueError(f"prompt.code: the kernel refused x [{t}, {k}]")
    return Coded(data, t, k, planes)


def expert(gate: tuple[QuantSpec, torch.Tensor], up: tuple[QuantSpec, torch.Tensor] | None,
           down: tuple[QuantSpec, torch.Tensor] | None, x: "torch.Tensor | Coded", out: torch.Tensor,
           rows: torch.Tensor | None = None, *, planes: int = 1, path: int = BEST) -> None:
    """One SwiGLU expert on a prompt's rows in one native call: x bf16 [T, H] coded once, gate and up (Q4_K, Q5_K or Q6_K, one format; up None
    when gate is [gate; up] as one [2I, H] matrix), silu(g) * u in float32, then a Q4_K or Q6_K down on it coded
    again, its rows rounded to bf16 into out [T, H]; down None writes the product rounded to bf16 into out [T, I]
    instead (for a down of another format, run by the caller). With x a Coded (code()) and `rows` (int64 [T] row indices into
    it), the expert runs on those rows of the coded x, the same bits as on those rows of x itself. `planes`: the
    activations' coding (a Coded x carries its own)."""
    need()
    _check_planes(planes)
    if isinstance(x, Coded):
        planes = x.planes
        if not (isinstance(rows, torch.Tensor) and rows.dtype is torch.int64 and rows.dim() == 1
                and rows.is_contiguous() and rows.is_cpu):
            raise ValueError(f"prompt.expert: rows must be a contiguous CPU int64 [T] tensor with a Coded x, got "
                             f"{rows.dtype if isinstance(rows, torch.Tensor) else type(rows).__name__}")
        t, h = rows.numel(), x.cols
    elif not (isinstance(x, torch.Tensor) and x.dtype is torch.bfloat16 and x.dim() == 2 and x.is_cpu
              and x.is_contiguous()) or rows is not None:
        got = f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a contiguous CPU bf16 [T, H] tensor (rows only with a Coded x), got {got}")
    else:
        t, h = x.shape
    i = gate[0].out_features // (1 if up is not None else 2)
    g = _codes(*gate, i if up is not None else 2 * i, h, "gate", AVX2_FORMATS)
    u = _codes(*up, i, h, "up", AVX2_FORMATS) if up is not None else (None, 0, g[2])
    if u[2] != g[2]:
        raise ValueError(f"prompt.expert: gate and up must share a format, got {gate[0].name} and {up[0].name}")
    d = _codes(*down, h, i, "down", AVX2_FORMATS) if down is not None else (None, 0, 0)
    n = h if down is not None else i
    if not (isinstance(out, torch.Tensor) and out.dtype is torch.bfloat16 and out.is_cpu and out.is_contiguous()
            and tuple(out.shape) == (t, n)):
        got = f"{out.dtype} {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out must be a contiguous bf16 [{t}, {n}] tensor, got {got}")
    y, hh = (out.data_ptr(), None) if down is not None else (None, out.data_ptr())
    if isinstance(x, Coded):
        rc = _LIB.sluice_prompt_expert_coded(*g[:2], *u, *d, h, i, None, x.data.data_ptr(), x.rows, rows.data_ptr(), t,
                                             y, hh, planes, path)
    else:
        rc = _LIB.sluice_prompt_expert(*g[:2], *u, *d, h, i, x.data_ptr(), t, y, hh, planes, path)
    if rc == -1:
        raise MemoryError(f"prompt.expert: no memory for a [{t} x {h}] expert's scratch")
    if rc:
        raise ValueError(f"prompt.expert: the kernel refused its arguments (code {rc})")
