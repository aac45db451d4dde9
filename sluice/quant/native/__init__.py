"""Native CPU kernels: y = x @ W^T straight from W's stored bytes (kernels.c, built at install time by setup.py).

    from sluice.quant import native
    native.native_available()                 # False when the extension was not built (no compiler): use torch
    native.supports(spec)                     # the formats below, for this QuantSpec
    y = native.linear(spec, x, raw)           # x float32 [T, in] contiguous, raw uint8 [spec.nbytes] -> y [T, out]
    y = native.linear_mlx(x, weight, scales, biases, bits=4, group_size=64)   # MLX's three separate buffers
    w = native.dequantize(spec, raw, out)     # the exact float32 weights [out, in] (bitwise the reference)
    native.q8_supported(spec)                 # GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K: the int8 path exists
    xq = native.quantize_q8(x, spec=spec)     # x float32 [T, in] -> 8-bit codes, uint8 [T, q8_row_bytes(in)]
    y = native.linear_q8(spec, x, raw)        # int8 activations x integer dots (q8.c), y float32 [T, out]
    q, k, v = native.LinearsQ8([(spec_q, raw_q), ...])(x)  # several projections of one x in one call, rows
                                              # split over set_threads' threads (pool.c)
    y = native.expert_q8(specs, raws, x)      # down(silu(gate x) * up x) in one call, y float32 [T, H]
    call = native.ExpertCall(specs, offsets); call.many(raw, slots, x, ys, rows)  # a layer's experts, one call
    out = native.rms_norm_bf16(x, w, eps); native.combine_bf16(ys, w, at, out)    # decode's small steps (ops.c)
    native.combine_rows_bf16(ys, w, at, out)  # a prompt's weighted sum of its expert outputs, bf16 (ops.c)
    k = native.NativeKernel(spec, dtype)      # kernel_for's interface: name "native", nbytes = stored bytes
    pool = native.Pool(2); pool.run([lambda: ..., ...])   # jobs on persistent Python threads, results in order
    pool.linear(spec, x, raw)                 # one projection's output rows split over those threads (float path)
    native.set_threads(2)                     # the C pool's threads and the Python pool's, process-wide
    native.pool_phase(prompt=True)            # the C pool's wait between jobs for a prompt (short) or decode
    from sluice.quant.native import prompt, attend  # a prompt's Q4_K projections on 8-bit codes (prompt.c,
                                              # --activations int8, AVX512-VNNI) and its causal attention in one
                                              # call (attend.c, AVX512_BF16); their modules say more

Formats: GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4 (stored blocks exactly as in the file), MLX
affine 4 / 8 bits with groups of 32, 64 or 128 and f32 / f16 / bf16 scales, and gpt-oss MXFP4 (QuantSpec.mxfp4:
*_blocks and *_scales; code 8 is +0, as spec.dequantize has it). Each output row's weights are
dequantized exactly (the value each weight has is sluice.quant.ggml.dequantize's, i.e. gguf's) and dotted with
FMA in float32; the dot products' order depends on in_features only, so the result is deterministic (whatever T,
thread or row range) and within ~1e-6 relative of F.linear on the exact weights. No activation quantization.
The integer path (linear_q8, expert_q8; q8.c) quantizes each x row once to two planes of 8-bit codes (Q8_PLANES;
one plane is llama.cpp's scheme) and runs integer dot products (maddubs / madd) against the stored codes of the
GGUF block formats: a [512 x 1024] Q4_K projection at T=1 75 -> 45 us of C time, relative L2 ~3e-5 against the
exact weights. NativeKernel runs it at the bf16 / f16 compute dtypes up to kernel.Q8_MAX_ROWS rows, and
models/experts.py runs a whole SwiGLU expert as one expert_q8 call (a Q4_K expert at T=1: 0.48 -> 0.25 ms at
1024 x 512, benchmarks/results/native_kernels.md).

The kernels hold no lock and keep no state, and ctypes releases the GIL while they run: calls on several Python
threads run in parallel (Pool). LinearsQ8 and ExpertCall.many split their rows over the extension's own threads
(pool.c: one job at a time; a call made while another runs computes on its calling thread), each output element
computed as one thread would compute it, so any thread count gives the same bits. Arguments are checked here and a
bad one raises ValueError naming it; the C code reads its buffers with unaligned loads, so no alignment is
required.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from ..kernels import QuantSpec

log = logging.getLogger(__name__)

_GGML = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7, "MXFP4": 8}
_MLX = {4: 9, 8: 10}
_MXFP4_OAI = 11  # gpt-oss's *_blocks / *_scales (QuantSpec.mxfp4)
_SCALE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
FORMATS = frozenset(_GGML) | {"mlx4", "mlx8", "mxfp4"}


def _load() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec(f"{__name__}._kernels")
    if spec is None or spec.origin is None:  # said once, when a quantized model first needs it (warn_unbuilt)
        return None
    lib = ctypes.CDLL(spec.origin)
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    desc = [i32, i64, i64, ptr, i64, ptr, ptr, i32, i32]  # fmt, N, K, q, row_bytes, scales, biases, sdt, gs
    lib.sluice_linear.argtypes = desc + [ptr, i64, ptr, i64, i64, i32]  # x, T, y, n0, n1, scalar
    lib.sluice_dequantize.argtypes = desc + [ptr, i64, i64, i32]  # out, n0, n1, scalar
    lib.sluice_rows_pool.argtypes = desc + [ptr, i64, ptr, ptr, i32]  # x, T, y (or NULL), out (or NULL), scalar
    lib.sluice_rows_pool.restype = i32
    lib.sluice_dequantize_bf16.argtypes = desc + [ptr, i32]  # out16, scalar
    lib.sluice_dequantize_bf16.restype = i32
    lib.sluice_linear.restype = lib.sluice_dequantize.restype = lib.sluice_simd.restype = i32
    lib.sluice_quantize_q8.argtypes = [i64, ptr, i64, ptr, i32, i32]  # K, x, T, xq, planes, scalar
    lib.sluice_quantize_q8.restype = None
    lib.sluice_linear_q8.argtypes = [i32, i64, i64, ptr, i64, ptr, ptr, i64, i32, ptr, i64, i64, i32]  # xq, x, T, ..
    lib.sluice_linear_q8.restype = i32
    lib.sluice_expert_q8.argtypes = [i32, ptr, i64] * 3 + [i64, i64, ptr, i64, i32, ptr, i32]  # H, I, x, T, P, y
    lib.sluice_expert_q8.restype = i32
    lib.sluice_linears_q8.argtypes = [i64, ptr, i64, ptr, i64, i32, i32]  # m, descs, K, x, T, planes, scalar
    lib.sluice_experts_q8.argtypes = [i64, ptr, i64, i64, ptr, i64, i32, i32]  # n, experts, H, I, x, T, P, scalar
    lib.sluice_linears_q8.restype = lib.sluice_experts_q8.restype = lib.sluice_threads.restype = i32
    lib.sluice_set_threads.argtypes = [i32]
    lib.sluice_q8_layout.argtypes = [i32, i32]
    lib.sluice_q8_row_bytes.argtypes = [i64, i32]
    lib.sluice_q8_row_bytes.restype = i64
    lib.sluice_set_super_blocks.argtypes = [i32]
    lib.sluice_set_super_blocks.restype = None
    lib.sluice_set_prefetch.argtypes = [i64]
    lib.sluice_set_prefetch.restype = None
    lib.sluice_q8_layout.restype = i32
    lib.sluice_combine_bf16.argtypes = [i64, ptr, i64, ptr, i32, ptr, ptr]  # n, ys, H, w, w_f32, at, out
    lib.sluice_combine_rows_bf16.argtypes = [i64, i64, i64, ptr, ptr, i32, ptr, ptr]  # T, K, H, ys, w, w_f32, at, out
    lib.sluice_combine_rows_bf16.restype = None
    lib.sluice_rms_norm_bf16.argtypes = [i64, i64, ptr, ptr, ctypes.c_float, ptr]  # rows, n, x, w, eps, out
    lib.sluice_rope_bf16.argtypes = [i64, i64, i64, i64, ptr, i64, i64, ptr, ptr, ptr]  # heads, T, D, rot, x, sh, st
    lib.sluice_set_threads.restype = lib.sluice_combine_bf16.restype = lib.sluice_rms_norm_bf16.restype = None
    lib.sluice_rope_bf16.restype = None
    lib.sluice_to_bf16.argtypes = [i64, ptr, ptr, i32]  # n, x float32, out bf16, scalar
    lib.sluice_to_bf16.restype = None
    lib.sluice_set_spin.argtypes = [i64, i64]
    lib.sluice_set_spin.restype = None
    lib.sluice_ops_scalar.argtypes = [i32]
    lib.sluice_ops_scalar.restype = None
    lib.sluice_keep_release.argtypes = []
    lib.sluice_keep_release.restype = None
    return lib


_LIB = _load()
#: test hooks, read at every call (tests set them with monkeypatch, which restores them): FORCE_SCALAR runs the
#: portable C path even where AVX2 is available; AVX2_ONLY keeps the AVX2 path but none of the AVX-512 ones (kernels.c's
#: AVX512_BF16 rounding to bf16, prompt.c's VNNI tiles), as an AVX2-only CPU runs them, so one CPU tests all three
FORCE_SCALAR = False
AVX2_ONLY = False
_ops_scalar = 0  # what ops.c was last told (_sync_ops)
#: LoadOptions.isa's choices and the path cap each sets (set_isa)
ISA_CAPS = {"auto": 0, "avx2": 2, "portable": 1}
_isa_cap = 0  # set_isa's cap: what a load asked for (the test hooks above tighten it further)


def set_isa(mode: str) -> None:
    """Cap the instruction sets the C kernels use, process-wide like the thread count (engine.py sets it at each load
    from LoadOptions.isa): "auto" the best this CPU has, "avx2" at most AVX2 (none of the AVX-512 paths: the
    float32 -> bf16 rounding, prompt.c's VNNI tiles, attend.c), as an AVX2-only CPU runs them, "portable" no SIMD."""
    global _isa_cap
    if mode not in ISA_CAPS:
        raise ValueError(f"isa {mode!r}: expected one of {', '.join(ISA_CAPS)}")
    _isa_cap = ISA_CAPS[mode]


def isa_capped() -> bool:
    """Whether a load capped the kernels below this CPU's best (set_isa): the AVX-512-only kernels (prompt.c's VNNI
    tiles, attend.c) are then not chosen, as on a CPU without them."""
    return _isa_cap != 0


def _path() -> int:
    """The C entry points' `scalar` argument, the path cap of common.h: 1 portable, 2 at most AVX2, 0 the best."""
    if FORCE_SCALAR or _isa_cap == 1:
        return 1
    return 2 if AVX2_ONLY or _isa_cap == 2 else 0


def _sync_ops() -> None:
    """Tell ops.c's vectorized loops (rms_norm, rope, combine_rows) whether FORCE_SCALAR asks for the portable ones."""
    global _ops_scalar
    if _path() != _ops_scalar:
        _ops_scalar = _path()
        _LIB.sluice_ops_scalar(_ops_scalar)


_warned = False


def warn_unbuilt() -> None:
    """One warning line, the first time a quantized projection runs on the torch kernels for want of the build
    (a model without quantized experts never needs the extension, so it is not mentioned at import)."""
    global _warned
    if _LIB is None and not _warned:
        _warned = True
        log.warning("sluice: native quantized kernels not built (no C compiler at install?); using the slower torch "
                    "kernels. Reinstall with a C compiler (gcc or clang) to build them.")


def native_available() -> bool:
    """Whether the extension is built and loaded (False: callers use the torch kernels)."""
    return _LIB is not None


def simd() -> bool:
    """Whether the AVX2 + FMA + F16C path runs on this CPU (else the portable scalar one)."""
    return _LIB is not None and bool(_LIB.sluice_simd())


def supports(spec: QuantSpec) -> bool:
    """Whether the native kernels compute this format (MLX: 4 or 8 bits, groups a multiple of 32)."""
    if spec.family == "ggml":
        return spec.name in _GGML
    if spec.family == "mxfp4":
        return True
    return spec.family == "mlx" and spec.bits in _MLX and spec.group_size % 32 == 0


def _buffer(t: torch.Tensor, what: str, dtype: torch.dtype, numel: int) -> int:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
        got = f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{what} must be a contiguous CPU {dtype} tensor, got {got}")
    if t.numel() != numel:
        raise ValueError(f"{what} must have {numel} elements, got {t.numel()} (shape {tuple(t.shape)})")
    return t.data_ptr()


def _check_x(x: torch.Tensor, k: int) -> torch.Tensor:
    # the checks cost ~1 us each: the common case is tested first, the message built only for a bad argument
    if not (type(x) is torch.Tensor and x.dtype is torch.float32 and x.dim() == 2 and x.shape[1] == k
            and x.is_cpu and x.is_contiguous()):
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"x must be [T, {k}], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        _buffer(x, "x", torch.float32, x.numel())
    return x


def _x_out(x: torch.Tensor, out: torch.Tensor | None, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = _check_x(x, k)
    t = x.shape[0]
    if out is None:
        return x, torch.empty(t, n, dtype=torch.float32)
    _buffer(out, f"out ([{t}, {n}])", torch.float32, t * n)
    return x, out.view(t, n)


@functools.lru_cache(maxsize=4096)
def _layout(spec: QuantSpec) -> tuple:
    """(stored bytes, C format, N, K, codes offset, codes bytes per row, scales offset, biases offset, scale dtype,
    group) of a format native computes; computed once per spec (spec.parts builds its layout on every access)."""
    if not supports(spec):
        raise ValueError(f"the native kernels do not compute {spec.family} {spec.name} (see native.FORMATS)")
    n, k = spec.out_features, spec.in_features
    parts = {p.name: p for p in spec.parts}
    if spec.family == "ggml":
        return (spec.nbytes, _GGML[spec.name], n, k, parts["blocks"].offset, parts["blocks"].shape[1], None, None,
                0, 0)
    if spec.family == "mxfp4":
        return (spec.nbytes, _MXFP4_OAI, n, k, parts["blocks"].offset, k // 2, parts["scales"].offset, None, 0, 32)
    if spec.scale_dtype not in _SCALE_DTYPES:
        raise ValueError(f"MLX scales must be float32, float16 or bfloat16, got {spec.scale_dtype}")
    w = parts["weight"]
    return (spec.nbytes, _MLX[spec.bits], n, k, w.offset, w.nbytes // n, parts["scales"].offset,
            parts["biases"].offset, _SCALE_DTYPES[spec.scale_dtype], spec.group_size)


def _desc(spec: QuantSpec, raw: torch.Tensor) -> tuple:
    """The C descriptor arguments of one projection's stored bytes (checked)."""
    nbytes, fmt, n, k, q, row_bytes, s, b, sdt, gs = _layout(spec)
    if not (type(raw) is torch.Tensor and raw.dtype is torch.uint8 and raw.dim() == 1 and raw.numel() == nbytes
            and raw.is_cpu and raw.is_contiguous()):
        if not isinstance(raw, torch.Tensor) or raw.dim() != 1:
            raise ValueError(f"raw must be the 1-D uint8 stored bytes of {spec.name}, got "
                             f"{tuple(raw.shape) if isinstance(raw, torch.Tensor) else type(raw).__name__}")
        _buffer(raw, f"raw ({spec.name} [{n}, {k}])", torch.uint8, nbytes)
    base = raw.data_ptr()
    return (fmt, n, k, base + q, row_bytes, None if s is None else base + s, None if b is None else base + b, sdt,
            gs)


def _rows(rows: tuple[int, int] | None, n: int) -> tuple[int, int]:
    n0, n1 = (0, n) if rows is None else rows
    if not 0 <= n0 <= n1 <= n:
        raise ValueError(f"rows must be (n0, n1) with 0 <= n0 <= n1 <= {n}, got {rows}")
    return n0, n1


def _run(desc: tuple, x: torch.Tensor, out: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    if _LIB is None:
        raise RuntimeError("the native kernels are not built (native_available() is False); use the torch kernels")
    if rows is None:  # all rows, split over set_threads' pool (a prefill's experts): the same bits
        rc = _LIB.sluice_rows_pool(*desc, x.data_ptr(), x.shape[0], out.data_ptr(), None, _path())
    else:
        n0, n1 = _rows(rows, desc[1])
        rc = _LIB.sluice_linear(*desc, x.data_ptr(), x.shape[0], out.data_ptr(), n0, n1, _path())
    if rc:
        raise MemoryError(f"native linear failed (code {rc}): no memory for a {desc[2]}-value row buffer")
    return out


def linear(spec: QuantSpec, x: torch.Tensor, raw: torch.Tensor, out: torch.Tensor | None = None,
           rows: tuple[int, int] | None = None) -> torch.Tensor:
    """y [T, out] (float32) = x [T, in] (float32, contiguous) @ W^T, W from its stored bytes raw (uint8
    [spec.nbytes], spec.parts' layout). out: optional float32 [T, out] to write into. rows=(n0, n1): only those
    output columns are written (one projection split over threads; each column is one whole dot product)."""
    desc = _desc(spec, raw)
    x, out = _x_out(x, out, spec.out_features, spec.in_features)
    return _run(desc, x, out, rows)


def linear_mlx(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, *, bits: int,
               group_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """MLX affine from its three buffers: weight uint32/int32 [out, in * bits / 32], scales and biases
    [out, in / group_size] (f32 / f16 / bf16, one dtype); y [T, out] = x [T, in] @ W^T, float32."""
    if not isinstance(scales, torch.Tensor) or scales.dim() != 2 or weight.dim() != 2:
        raise ValueError("MLX weight, scales and biases must be 2-D tensors")
    n, groups = scales.shape
    spec = QuantSpec.mlx(bits, group_size, n, groups * group_size, scales.dtype)
    if not supports(spec):
        raise ValueError(f"the native kernels compute MLX 4 and 8 bits with groups of 32/64/128, got bits={bits} "
                         f"group_size={group_size}")
    if weight.dtype not in (torch.int32, torch.uint32) or biases.dtype != scales.dtype:
        raise ValueError(f"MLX weight must be uint32/int32 and biases {scales.dtype}, got {weight.dtype} and "
                         f"{biases.dtype}")
    k = spec.in_features
    q = _buffer(weight, "weight", weight.dtype, n * k * bits // 32)
    s = _buffer(scales, "scales", scales.dtype, n * groups)
    b = _buffer(biases, "biases", scales.dtype, n * groups)
    x, out = _x_out(x, out, n, k)
    desc = (_MLX[bits], n, k, q, k * bits // 8, s, b, _SCALE_DTYPES[scales.dtype], group_size)
    return _run(desc, x, out, None)


def dequantize(spec: QuantSpec, raw: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weights [out, in] of the stored bytes, bitwise spec.dequantize(raw), into out (float32,
    contiguous, out * in elements) or a new tensor; into a bf16 out, those weights rounded to bf16 (bitwise
    `.to(torch.bfloat16)` of them, without the float32 pass: a bf16 GEMM's operand). Rows over the pool."""
    if _LIB is None:
        raise RuntimeError("the native kernels are not built (native_available() is False); use spec.dequantize")
    desc = _desc(spec, raw)
    n, k = spec.out_features, spec.in_features
    if out is None:
        out = torch.empty(n, k)
    if out.dtype is torch.bfloat16:
        _buffer(out, f"out ([{n}, {k}])", torch.bfloat16, n * k)
        if _LIB.sluice_dequantize_bf16(*desc, out.data_ptr(), _path()):
            raise MemoryError(f"native dequantize: no memory for a {k}-value row buffer")
        return out.view(n, k)
    _buffer(out, f"out ([{n}, {k}])", torch.float32, n * k)
    _LIB.sluice_rows_pool(*desc, None, 0, None, out.data_ptr(), _path())  # rows over the pool
    return out.view(n, k)


def q8_supported(spec: QuantSpec) -> bool:
    """Whether the int8-activation path (linear_q8) computes this format: the GGUF block types (not MXFP4 / MLX)."""
    return spec.family == "ggml" and spec.name in _GGML and spec.name != "MXFP4"


#: planes of 8-bit activation codes linear_q8 uses when a call names none (a model names its own:
#: LoadOptions.activations). 1 is llama.cpp's scheme (x rounded to 1/127 of each 32-block's max, of each 256-block's
#: for the K-quants as its Q8_K does): faster, but it took the tiny random Q5_K model of
#: tests/quant/test_gguf_models.py to 6.6e-2 relative L2 of the logits at the default dtype (float kernel 3.1e-2,
#: transformers' own bf16 run 4.4e-2: the model amplifies small errors) and a random expert's output up to 2.5e-2
#: off the exact weights' (tests/quant/test_q8.py). 2 adds the residual in 1/256ths (x to
#: ~1/32,000 of the block max, finer than bf16): the same logits as the float kernel to bf16 rounding.
Q8_PLANES = 2


def q8_row_bytes(in_features: int, planes: int | None = None, spec: QuantSpec | None = None) -> int:
    """Bytes of one quantized x row in the layout `spec`'s rows read (q8.c sluice_q8_row_bytes): per 32 values
    float d, float d * sum, `planes` x 32 int8 codes; the K-quants: per 256 values float d, 16 int32 sums, `planes`
    planes of 256 codes. spec None: the 32-value layout."""
    return _LIB.sluice_q8_row_bytes(in_features, _layout_of(spec, _planes(planes)))


def set_super_blocks(on: bool) -> None:
    """Benchmark hook: False makes the K-quants read x in 32-value blocks, as before the super-block layout (q8.c),
    process-wide, until set back (`benchmarks/knobs.py layouts`). Default True."""
    _LIB.sluice_set_super_blocks(int(on))


def set_prefetch(nbytes: int) -> None:
    """Benchmark hook: how far ahead (bytes) the integer path's row loop prefetches a task's weight rows (q8.c),
    process-wide; 0 turns it off. Default 2048."""
    _LIB.sluice_set_prefetch(int(nbytes))


def _layout_of(spec: QuantSpec | None, planes: int) -> int:
    """The C x layout (XF) spec's rows read with `planes`: 1 or 2 (32-value blocks), 3 (super-blocks)."""
    if spec is None:
        return planes
    return _LIB.sluice_q8_layout(_layout(spec)[1], planes)


def _planes(planes: int | None) -> int:
    """planes, or Q8_PLANES as it is now (a benchmark may set native.Q8_PLANES = 1 for a whole run)."""
    if planes is None:
        return Q8_PLANES
    if planes not in (1, 2):
        raise ValueError(f"planes must be 1 or 2, got {planes}")
    return planes


def quantize_q8(x: torch.Tensor, planes: int | None = None, out: torch.Tensor | None = None,
                spec: QuantSpec | None = None) -> torch.Tensor:
    """x float32 [T, in] (contiguous, in a multiple of 32) -> its 8-bit codes, uint8 [T, q8_row_bytes(in, planes,
    spec)] (into out when given), in the layout the rows of `spec` read (None: the 32-value blocks every format
    but the two-plane K-quants reads). linear_q8(spec, x, raw, xq=...) takes it."""
    if _LIB is None:
        raise RuntimeError("the native kernels are not built (native_available() is False)")
    k = x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() == 2 else 0
    if k == 0 or k % 32:
        raise ValueError(f"x must be [T, in] with in a positive multiple of 32, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    x = _check_x(x, k)
    planes = _planes(planes)
    rb = q8_row_bytes(k, planes, spec)
    if out is None:
        out = torch.empty(x.shape[0], rb, dtype=torch.uint8)
    _buffer(out, f"xq ([{x.shape[0]}, {rb}])", torch.uint8, x.shape[0] * rb)
    _LIB.sluice_quantize_q8(k, x.data_ptr(), x.shape[0], out.data_ptr(), _layout_of(spec, planes), _path())
    return out.view(x.shape[0], rb)


def linear_q8(spec: QuantSpec, x: torch.Tensor, raw: torch.Tensor, out: torch.Tensor | None = None,
              xq: torch.Tensor | None = None, planes: int | None = None) -> torch.Tensor:
    """y [T, out] (float32) = x [T, in] @ W^T on the integer path: x quantized to `planes` planes of 8-bit codes (or
    xq, quantize_q8's result for this x and planes, reused), integer dot products against the stored codes.
    Deterministic, the same bits on the AVX2 and the scalar path and for any T. Relative L2 against the exact
    weights (tests/quant/test_q8.py): planes=1 5e-3 - 1.1e-2, planes=2 2e-5 - 4e-5. planes None: Q8_PLANES."""
    desc, x, out = _q8_args(spec, x, raw, out)
    if xq is not None:
        _buffer(xq, "xq", torch.uint8, x.shape[0] * q8_row_bytes(spec.in_features, planes, spec))
    return _run_q8(desc, xq, x, out, _planes(planes), (0, spec.out_features))


def _q8_args(spec: QuantSpec, x: torch.Tensor, raw: torch.Tensor, out: torch.Tensor | None) -> tuple:
    """(format, N, K, codes address, bytes per row), x and out of one linear_q8 call, checked."""
    if not q8_supported(spec):
        raise ValueError(f"the int8 path does not compute {spec.family} {spec.name} (see native.q8_supported)")
    desc = _desc(spec, raw)[:5]
    return (desc, *_x_out(x, out, spec.out_features, spec.in_features))


def _run_q8(desc: tuple, xq: torch.Tensor | None, x: torch.Tensor, out: torch.Tensor, planes: int,
            rows: tuple[int, int]) -> torch.Tensor:
    """Output columns rows=(n0, n1) of the integer path (x quantized here when xq is None)."""
    rc = _LIB.sluice_linear_q8(*desc, None if xq is None else xq.data_ptr(), x.data_ptr(), x.shape[0], planes,
                               out.data_ptr(), rows[0], rows[1], _path())
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

    def __call__(self, x: torch.Tensor, planes: int | None = None,
                 out_dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        x = _check_x(x, self.k)
        if out_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"LinearsQ8 writes float32 or bfloat16, got {out_dtype}")
        t, bf16 = x.shape[0], int(out_dtype is torch.bfloat16)
        ys, vals = [], []
        for (fmt, n, _, q, row_bytes), ni in zip(self.descs, self.ns):
            y = torch.empty(t, ni, dtype=out_dtype)  # one op each (views of one block took two more each)
            ys.append(y)
            vals += (fmt, n, q, row_bytes, y.data_ptr(), bf16)
        rc = _LIB.sluice_linears_q8(len(self.ns), self._arr(*vals), self.k, x.data_ptr(), t, _planes(planes), _path())
        if rc:
            raise MemoryError(f"native linears_q8 failed (code {rc}): no memory for {t} quantized rows")
        return ys


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
    return h, i, tuple((lay[1], lay[4], lay[5], lay[0]) for lay in map(_layout, specs))


def expert_q8(specs: tuple, raws: tuple, x: torch.Tensor, out: torch.Tensor | None = None,
              planes: int | None = None) -> torch.Tensor:
    """One SwiGLU expert on the integer path in one native call: y [T, H] float32 = down(silu(gate x) * up x), specs
    (gate [I, H], up [I, H], down [H, I]) QuantSpecs of formats q8_supported, raws their stored bytes, x float32
    [T, H]. x is quantized once for gate and up; silu(g) * u is computed in float32 and quantized once for down.
    The same bits on both C paths and for any T; gate / up / down each as linear_q8 computes them.
    The checks that depend on specs only run once per specs (~35 -> ~15 us of Python per call)."""
    h, i, parts = _expert_layout(tuple(specs))
    args = []
    for (fmt, at, row_bytes, nbytes), spec, raw in zip(parts, specs, raws):
        if not (type(raw) is torch.Tensor and raw.dtype is torch.uint8 and raw.dim() == 1 and raw.numel() == nbytes
                and raw.is_cpu and raw.is_contiguous()):
            _desc(spec, raw)  # raises, naming what is wrong
        args += (fmt, raw.data_ptr() + at, row_bytes)
    x, out = _x_out(x, out, h, h)
    return _run_expert(args, h, i, x, out, planes)


def _run_expert(args: tuple | list, h: int, i: int, x: torch.Tensor, out: torch.Tensor,
                planes: int | None) -> torch.Tensor:
    """The C call behind expert_q8 and ExpertCall: args (format, codes address, bytes per row) of gate, up, down."""
    rc = _LIB.sluice_expert_q8(*args, h, i, x.data_ptr(), x.shape[0], _planes(planes), out.data_ptr(), _path())
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

    def __call__(self, slot: torch.Tensor, x: torch.Tensor, out: torch.Tensor, planes: int | None = None) -> None:
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
        _run_expert((gf, base + ga, gr, uf, base + ua, ur, df, base + da, dr), h, self.i, x, out, planes)

    def many(self, raw: torch.Tensor, slots: list[int], x: torch.Tensor, ys: torch.Tensor, rows: list[int],
             planes: int | None = None) -> None:
        """The experts in rows `slots` of raw (uint8 [S, >= nbytes], one expert per row, rows contiguous) on the
        same x float32 [T, H], expert e into ys[rows[e]] (ys float32 [R, T, H], or [R, H] when T == 1), in one
        native call, the rows of all their projections split over the threads of set_threads (q8.c
        sluice_experts_q8): each output is bitwise what call(raw[slots[e]], x, ys[rows[e]]) writes, whatever the
        thread count. Addresses instead of
        slices: a slice is a torch op (~3 us), and a decode layer passes 8 experts."""
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
        rc = _LIB.sluice_experts_q8(n, (ctypes.c_int64 * len(vals))(*vals), h, self.i, x.data_ptr(), x.shape[0],
                                    _planes(planes), _path())
        if rc:
            raise MemoryError(f"native experts failed (code {rc}): no memory for {n} experts' [{x.shape[0]} x "
                              f"{self.i}] scratch")


def combine_bf16(ys: torch.Tensor, w: torch.Tensor, at: list[int], out: torch.Tensor) -> None:
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
    _LIB.sluice_combine_bf16(n, ys.data_ptr(), h, w.data_ptr(), int(w.dtype is torch.float32),
                             (ctypes.c_int64 * n)(*at), out.data_ptr())


def combine_rows_bf16(ys: torch.Tensor, w: torch.Tensor, at: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A prompt's weighted sum of expert outputs (ops.c): out[t] = sum over r of ys[at[t, r]] * w[at[t, r]], each
    product rounded to bf16 and added to out (from zeros) in r order; bitwise `ys.mul_(w[:, None])` then `out =
    zeros; for r: out += ys[at[:, r]]`, without changing ys. ys bf16 [T*K, H], w bf16 / float32 [T*K], at int64
    [T, K] (rows of ys, checked), out bf16 [T, H]; tokens split over set_threads' pool."""
    T, K = at.shape
    n, h = ys.shape
    if not (ys.dtype is torch.bfloat16 and out.dtype is torch.bfloat16 and w.dtype in (torch.bfloat16, torch.float32)
            and at.dtype is torch.int64 and all(t.is_contiguous() for t in (ys, w, at, out))
            and w.numel() == n and tuple(out.shape) == (T, h) and (at.numel() == 0 or 0 <= int(at.min()) and
                                                                   int(at.max()) < n)):
        raise ValueError(f"combine_rows_bf16: need ys bf16 [n, H], w bf16/float32 [n], at int64 [T, K] of rows < n "
                         f"and out bf16 [T, H], got {ys.dtype} {list(ys.shape)}, {w.dtype} {list(w.shape)}, "
                         f"{at.dtype} {list(at.shape)}, {out.dtype} {list(out.shape)}")
    _sync_ops()
    _LIB.sluice_combine_rows_bf16(T, K, h, ys.data_ptr(), w.data_ptr(), int(w.dtype is torch.float32),
                                  at.data_ptr(), out.data_ptr())
    return out


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of bf16 x [..., n] (contiguous) with bf16 weight [n] (ops.c): the reference's steps (float32
    statistics, the row rounded to bf16, times the weight) in one call instead of eight torch ops (~45 us at one
    1024-wide row here); its sum of squares is in a fixed order of its own, so the scale may differ from torch's in
    the last bit."""
    n = x.shape[-1]
    if not (x.dtype is torch.bfloat16 and weight.dtype is torch.bfloat16 and x.is_contiguous()
            and weight.is_contiguous() and weight.numel() == n and x.device.type == "cpu"):
        raise ValueError(f"rms_norm_bf16: need contiguous bf16 x [..., n] and weight [n], got {x.dtype} "
                         f"{list(x.shape)} and {weight.dtype} {list(weight.shape)}")
    out = torch.empty_like(x)
    _sync_ops()
    _LIB.sluice_rms_norm_bf16(x.numel() // n if n else 0, n, x.data_ptr(), weight.data_ptr(), eps, out.data_ptr())
    return out


def rope_bf16(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
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
    _sync_ops()
    _LIB.sluice_rope_bf16(heads, t, d, rot, x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
                          out.data_ptr())
    return out


class Pool:
    """`threads` persistent worker threads for native calls (each releases the GIL): e.g. the experts of one MoE
    layer at decode split over the CPUs. Results come back in job order, so sums over them are deterministic."""

    def __init__(self, threads: int):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._ex = ThreadPoolExecutor(threads, thread_name_prefix="sluice-native")

    def run(self, jobs: list) -> list:
        """Runs each job (a callable without arguments) on the pool; returns their results in job order."""
        return [f.result() for f in [self._ex.submit(j) for j in jobs]]

    def linear(self, spec: QuantSpec, x: torch.Tensor, raw: torch.Tensor, out: torch.Tensor | None = None):
        """native.linear with the output columns split into `threads` ranges, the first computed on the calling
        thread and the others on the pool (bitwise the same result as one call: each column is one dot product
        whichever thread computes it)."""
        desc = _desc(spec, raw)
        x, out = _x_out(x, out, spec.out_features, spec.in_features)
        return self._split(spec.out_features, lambda rows: _run(desc, x, out, rows), out)

    def _split(self, n: int, job, out: torch.Tensor) -> torch.Tensor:
        """job((n0, n1)) over `threads` ranges of n columns: the first on the calling thread, the others on the
        pool; returns out once all have run."""
        bounds = [n * i // self.threads for i in range(self.threads + 1)]
        futures = [self._ex.submit(job, (a, b)) for a, b in zip(bounds[1:-1], bounds[2:])]
        job((bounds[0], bounds[1]))
        for f in futures:
            f.result()
        return out

    def close(self) -> None:
        self._ex.shutdown(wait=True)


_SHARED: Pool | None = None


# How long the C pool's workers wait for the next job before they sleep (pool.c: spin, then sched_yield, ns). A
# decode step runs several native jobs per layer back to back, and a futex wake-up costs tens of us: they spin up to
# 1 ms. A prompt's native jobs (dequantizing an expert, its norms, rope, weighted sums) sit between torch GEMMs: a
# shorter wait gives those the CPU sooner, too short a one pays the wake-up at every job. Peers Q4_K_M, resident,
# quiet, `benchmarks/prefill/knobs.py wait` (waits alternated in one process, medians of 6), prefill ms with 1 ms /
# 200 us / 50 us: 128 tokens 481 / 482 / 497, 512 tokens 706 / 712 / 755, 2,048 tokens 2,032 / 2,034 / 2,084; decode
# 9.21 ms/token with the decode wait, 9.28 with the prompt's. Quiet, 200 us is the 1 ms wait's equal; it is the
# prompt's wait because in slow spells of this machine (the host's load) an earlier in-process comparison of the
# same kind, not kept, ran 2,048-token prompts faster with the shorter wait.
DECODE_WAIT = (50_000, 1_000_000)
PROMPT_WAIT = (50_000, 200_000)
_wait = DECODE_WAIT


def pool_phase(prompt: bool) -> None:
    """Set the C pool's wait between jobs for a prompt's forward pass (PROMPT_WAIT) or a decode step's
    (DECODE_WAIT); process-wide, like set_threads, and cheap when unchanged."""
    global _wait
    want = PROMPT_WAIT if prompt else DECODE_WAIT
    if _LIB is not None and want != _wait:
        _LIB.sluice_set_spin(*want)
        _wait = want


def release_scratch() -> None:
    """Free the scratch buffer the native prompt calls keep between calls (pool.c keep_take); the next call
    allocates it again. Transformer.forward calls it after a prompt's forward pass."""
    if _LIB is not None:
        _LIB.sluice_keep_release()


def set_threads(threads: int) -> None:
    """Threads the model's native work may split over, process-wide like torch.set_num_threads (the engine sets
    both from the plan's threads, and the thread governor lowers both beside a busy process): a decode step's
    experts of one layer (Transformer._native_experts), the output rows of large resident projections (QuantLinear,
    SPLIT_MIN_WEIGHTS). 1: everything on the calling thread. Any count gives the same bits.

    native.linear over all rows and native.dequantize split their rows over the C pool too (a prefill's experts of
    5+ rows, NativeKernel.linear): peers Q4_K_M, resident, prompts of 32 / 256 tokens prefilled in 359 / 2234 ms
    against 448 / 2815 with both on the calling thread (benchmarks/quantized/prefill_rows.py, removed: its command
    is in benchmarks/results/quantized/README.md). At T=1 a layer's experts go to the pool together instead
    (ExpertCall.many), the cheaper split there."""
    global _SHARED
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if _LIB is not None:
        _LIB.sluice_set_threads(threads)  # the C pool (pool.c): LinearsQ8, ExpertCall.many
    if (_SHARED.threads if _SHARED is not None else 1) == threads:
        return
    old, _SHARED = _SHARED, (Pool(threads) if threads > 1 else None)
    if old is not None:
        old.close()


def shared_pool() -> Pool | None:
    """The pool set_threads made (None for one thread)."""
    return _SHARED
