"""The built extension (setup.py: the C files of this folder in one library) and what every wrapper shares: the
argument checks and the descriptor of one projection's stored bytes. Each C file has its thin wrapper beside this one
(kernels.py, q8.py, ops.py, pool.py, decode.py, prompt.py, attend.py, deltanet.py, delta_prompt.py), which declares
its own entry points.

`path` (every wrapper's keyword): common.h's path cap, the model's Compute.path (LoadOptions.isa): BEST the best
this CPU has, AVX2 at most AVX2 (none of the AVX-512 code: what an AVX2-only CPU runs), PORTABLE the scalar C.
Every path gives the same bits where the kernels claim them (tests run each).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
import shlex
import shutil
import sysconfig

import torch

from ..spec import QuantSpec

log = logging.getLogger("sluice.quant.native")

BEST, PORTABLE, AVX2 = 0, 1, 2
PATHS = {"auto": BEST, "avx2": AVX2, "portable": PORTABLE}  # LoadOptions.isa -> the path cap

_GGML = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7, "MXFP4": 8,
         # the low-bit types (lowbit.c, q8_low.c): common.h's enum from Q2_K on (after FP8, 12)
         **{name: 13 + i for i, name in enumerate(("Q2_K", "Q3_K", "TQ1_0", "TQ2_0", "IQ4_NL", "IQ4_XS", "IQ2_XXS",
                                                    "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"))}}
_MLX = {4: 9, 8: 10}
_MXFP4_OAI = 11  # gpt-oss's *_blocks / *_scales (QuantSpec.mxfp4)
_FP8 = 12  # float8_e4m3fn codes with block scales (QuantSpec.fp8; fp8.h)
SCALE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
FORMATS = frozenset(_GGML) | {"mlx4", "mlx8", "mxfp4", "fp8_e4m3"}


def _load() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("sluice.quant.native._kernels")
    if spec is None or spec.origin is None:  # said once, when a quantized model first needs it (warn_unbuilt)
        return None
    lib = ctypes.CDLL(spec.origin)
    lib.sluice_simd.restype = ctypes.c_int
    return lib


LIB = _load()


def build_compiler(var: str, default: str) -> str | None:
    """The compiler setuptools builds the extensions with, if it is on PATH: $var (CC for the C sources, CXX for
    topk.cc), else the one this Python was built with, else `default`."""
    words = shlex.split(os.environ.get(var) or sysconfig.get_config_var(var) or default)
    return shutil.which(words[0]) if words else None


def available() -> bool:
    """Whether the extension is built and loaded (False: callers use the torch kernels)."""
    return LIB is not None


def simd() -> bool:
    """Whether the AVX2 + FMA + F16C path runs on this CPU (else the portable scalar one)."""
    return LIB is not None and bool(LIB.sluice_simd())


def need() -> ctypes.CDLL:
    """The library, or a RuntimeError saying it was not built (callers check available() first)."""
    if LIB is None:
        raise RuntimeError("the native kernels are not built (native.available() is False); use the torch kernels")
    return LIB


_warned = False


def warn_unbuilt() -> None:
    """One warning line, the first time a quantized projection runs on the torch kernels for want of the build
    (a model without quantized experts never needs the extension, so it is not mentioned at import)."""
    global _warned
    if LIB is None and not _warned:
        _warned = True
        log.warning("sluice: native quantized kernels not built (no C compiler at install?); using the slower torch "
                    "kernels. Reinstall with a C compiler (gcc or clang) to build them.")


def supports(spec: QuantSpec) -> bool:
    """Whether the native kernels compute this format (MLX: 4 or 8 bits, groups a multiple of 32; FP8: any
    QuantSpec.fp8 makes)."""
    if spec.family == "ggml":
        return spec.name in _GGML
    if spec.family in ("mxfp4", "fp8"):
        return True
    return spec.family == "mlx" and spec.bits in _MLX and spec.group_size % 32 == 0


def buffer(t: torch.Tensor, what: str, dtype: torch.dtype, numel: int) -> int:
    """t's address after checking it is a contiguous CPU tensor of `dtype` and `numel` elements (ValueError)."""
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
        got = f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{what} must be a contiguous CPU {dtype} tensor, got {got}")
    if t.numel() != numel:
        raise ValueError(f"{what} must have {numel} elements, got {t.numel()} (shape {tuple(t.shape)})")
    return t.data_ptr()


def check_x(x: torch.Tensor, k: int) -> torch.Tensor:
    """x after checking it is a contiguous float32 [T, k] CPU tensor (ValueError)."""
    # the checks cost ~1 us each: the common case is tested first, the message built only for a bad argument
    if not (type(x) is torch.Tensor and x.dtype is torch.float32 and x.dim() == 2 and x.shape[1] == k
            and x.is_cpu and x.is_contiguous()):
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"x must be [T, {k}], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        buffer(x, "x", torch.float32, x.numel())
    return x


def x_out(x: torch.Tensor, out: torch.Tensor | None, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x checked, out float32 [T, n]: the given one checked, or a new one)."""
    x = check_x(x, k)
    t = x.shape[0]
    if out is None:
        return x, torch.empty(t, n, dtype=torch.float32)
    buffer(out, f"out ([{t}, {n}])", torch.float32, t * n)
    return x, out.view(t, n)


@functools.lru_cache(maxsize=4096)
def layout(spec: QuantSpec) -> tuple:
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
    if spec.family == "fp8":  # sdt: the scales' dtype, the block's rows above it (fp8.h)
        return (spec.nbytes, _FP8, n, k, parts["weight"].offset, k, parts["scales"].offset, None,
                SCALE_DTYPES[spec.scale_dtype] | spec.block_rows << 8, spec.group_size)
    if spec.scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"MLX scales must be float32, float16 or bfloat16, got {spec.scale_dtype}")
    w = parts["weight"]
    return (spec.nbytes, _MLX[spec.bits], n, k, w.offset, w.nbytes // n, parts["scales"].offset,
            parts["biases"].offset, SCALE_DTYPES[spec.scale_dtype], spec.group_size)


def desc(spec: QuantSpec, raw: torch.Tensor) -> tuple:
    """The C descriptor arguments of one projection's stored bytes (checked)."""
    nbytes, fmt, n, k, q, row_bytes, s, b, sdt, gs = layout(spec)
    if not (type(raw) is torch.Tensor and raw.dtype is torch.uint8 and raw.dim() == 1 and raw.numel() == nbytes
            and raw.is_cpu and raw.is_contiguous()):
        if not isinstance(raw, torch.Tensor) or raw.dim() != 1:
            raise ValueError(f"raw must be the 1-D uint8 stored bytes of {spec.name}, got "
                             f"{tuple(raw.shape) if isinstance(raw, torch.Tensor) else type(raw).__name__}")
        buffer(raw, f"raw ({spec.name} [{n}, {k}])", torch.uint8, nbytes)
    base = raw.data_ptr()
    return (fmt, n, k, base + q, row_bytes, None if s is None else base + s, None if b is None else base + b, sdt,
            gs)
