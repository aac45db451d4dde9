"""The native kernels behind kernel_for's interface: a slot holds the stored bytes, `linear` picks the faster of the
row kernel and (native dequantization into the float32 scratch + one float32 matmul) by the number of rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...matmul import bf16_gemm
from ..kernels import Kernel
from . import dequantize, linear, linear_q8, q8_supported, supports

# Rows (tokens of one expert) up to which the native row kernel runs; above it the weights are dequantized natively
# into the float32 scratch (bitwise the reference weights) and torch's float32 matmul runs, whose blocking keeps x
# in cache where the row kernel re-reads it per output row. One [768 x 2048] projection, ms (row kernel /
# dequantize + matmul), one thread, thread CPU time, median of 11 interleaved rounds, dev VM at load ~10
# (benchmarks/results/native_kernels.md):
#   Q4_K  T=16 2.31 / 3.67   T=24 3.15 / 4.08   T=32 3.94 / 4.47   T=48 5.90 / 5.23   T=64 6.33 / 4.87
#   Q8_0  T=16 1.85 / 2.83   T=24 2.73 / 3.27   T=32 3.75 / 3.74   T=48 4.92 / 4.30   T=64 6.43 / 5.56
#   MLX4  T=16 2.36 / 3.37   T=24 2.44 / 3.22   T=32 3.59 / 4.02   T=48 6.01 / 4.63   T=64 7.69 / 6.67
# so the crossover is at 32-48 rows for every format measured (two earlier runs at load 6 and 10 agreed).
NATIVE_MAX_ROWS = 32

# Rows from which a bf16 projection runs as dequantize-to-bf16 + torch's bf16 GEMM where that GEMM is the fast one
# (matmul.bf16_gemm: bf16 dot-product instructions) instead of the float row kernel. ms, row kernel / dequantize to
# bf16 + GEMM, 2 threads, median of 30, 2-core AVX512_BF16 EPYC (benchmarks/prefill/knobs.py crossover):
#   Q4_K [1024 x 1024]  T=8 0.13 / 0.19   T=12 0.21 / 0.19   T=16 0.27 / 0.20   T=32 0.52 / 0.27   T=48 0.78 / 0.32
#   Q6_K [1024 x 512]   T=8 0.07 / 0.10   T=12 0.10 / 0.11   T=16 0.13 / 0.12   T=32 0.27 / 0.15   T=48 0.42 / 0.18
BF16_GEMM_MIN_ROWS = 16

# Rows up to which the integer path (native.linear_q8 / expert_q8) runs at bf16 / f16; above it the float row kernel,
# which dequantizes each weight row once for all rows, wins. One Q4_K / Q6_K / Q4_0 expert [1024 x 512], ms (one
# call on the integer path / three calls of the float row kernel), thread CPU time, best of 3 medians of 50, load ~5:
#   Q4_K  T=1 0.24 / 0.42   T=2 0.36 / 0.56   T=3 0.50 / 0.61   T=4 0.73 / 0.74
#   Q6_K  T=1 0.27 / 0.41   T=2 0.42 / 0.46   T=3 0.60 / 0.61   T=4 0.61 / 0.51
#   Q4_0  T=1 0.18 / 0.24   T=2 0.29 / 0.35   T=3 0.38 / 0.40   T=4 0.55 / 0.50
Q8_MAX_ROWS = 2


def bf16_gemm_rows(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether x's rows go to a bf16 GEMM on weights dequantized to bf16 (NativeKernel._bf16_gemm; the experts'
    dequantize-once path, models/experts.py) rather than the native row kernels, at compute dtype `dtype`."""
    return x.shape[0] >= BF16_GEMM_MIN_ROWS and x.dtype is torch.bfloat16 and dtype is torch.bfloat16 and bf16_gemm()


def bf16_view(scratch: torch.Tensor, numel: int) -> torch.Tensor:
    """The first `numel` bf16 values of a float32 scratch's memory (>= (numel + 1) // 2 floats): where the bf16 GEMM
    route dequantizes its weights (NativeKernel, resident.Scratch)."""
    return scratch[: (numel + 1) // 2].view(torch.bfloat16)[:numel]


class NativeKernel(Kernel):
    """kernel_for's Kernel for a format native.supports: name "native", the slot holds the stored bytes
    (nbytes = spec.nbytes, prepare is a copy), linear(x, slot, scratch) -> y in the compute dtype.

    Up to Q8_MAX_ROWS rows at the bf16 / f16 compute dtypes a GGUF block format runs the integer path
    (native.linear_q8: x quantized to two planes of 8-bit codes, integer dots; relative L2 ~3e-5 against the exact
    weights, finer than those dtypes' own rounding); float32 keeps the float row kernel (~1e-7). One [512 x 1024]
    projection at T=1, C time, best of 3 medians, machine at load ~5 (benchmarks/results/native_kernels.md has the
    full table): float / integer us, Q4_K 75 / 45, Q6_K 80 / 58, Q8_0 88 / 54, Q4_0 97 / 69."""

    name = "native"

    def __init__(self, spec, dtype, planes: int | None = None):
        """`planes`: the integer path's activation planes (None: native.Q8_PLANES when called)."""
        super().__init__(spec, dtype)
        self.int8 = dtype is not torch.float32 and q8_supported(spec)
        self.planes = planes

    def _parts(self):
        return self.spec.parts, self.spec.nbytes

    def _prepare(self, raw, slot):
        slot[: self.nbytes].copy_(raw[: self.nbytes])

    def dequantize(self, slot, scratch):
        return dequantize(self.spec, slot[: self.nbytes], scratch[: self.scratch_numel])

    def linear(self, x, slot, scratch):
        # per call ~20 us of Python around the C call (was 155 before the checks' fast paths): each step is
        # skipped when it would be a no-op
        if bf16_gemm_rows(x, self.dtype):
            return self._bf16_gemm(x, slot, scratch)
        if x.dtype is not torch.float32:
            x = x.float()  # [T, in]
        if not x.is_contiguous():
            x = x.contiguous()
        if slot.numel() != self.nbytes:
            slot = slot[: self.nbytes]
        if x.shape[0] <= Q8_MAX_ROWS and self.int8:
            y = linear_q8(self.spec, x, slot, planes=self.planes)
        elif x.shape[0] <= NATIVE_MAX_ROWS:
            y = linear(self.spec, x, slot)  # rows over set_threads' pool (native.linear)
        else:
            y = F.linear(x, self.dequantize(slot, scratch))
        return y if self.dtype is torch.float32 else y.to(self.dtype)

    def _bf16_gemm(self, x, slot, scratch):
        """Many bf16 rows where torch's bf16 GEMM is the fast one (matmul.bf16_gemm): the weights dequantized
        straight to bf16 (the exact weights rounded to nearest, relative error <= 2^-9 each, as bf16 activations
        are) into the scratch's memory, one bf16 GEMM (float32 accumulation, the output rounded once). Peers
        Q4_K_M, resident 2,048-token prefill on a 2-core AVX512_BF16 EPYC, the routes alternated in one process:
        279 tok/s on the float32 route, 580 on this one (`benchmarks/prefill/knobs.py matmul-prefill
        --model benchmarks/models/qwen3_moe-peers/model-Q4_K_M.gguf`)."""
        if not x.is_contiguous():
            x = x.contiguous()
        if slot.numel() != self.nbytes:
            slot = slot[: self.nbytes]
        w = dequantize(self.spec, slot, bf16_view(scratch, self.scratch_numel))
        return F.linear(x, w)


def native_kernel(spec, dtype: torch.dtype) -> NativeKernel:
    """The native kernel for spec at compute dtype (float32 / bfloat16 / float16); ValueError for a format the
    native kernels do not compute (check native.supports first)."""
    if not supports(spec):
        raise ValueError(f"the native kernels do not compute {spec.family} {spec.name}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"compute dtype must be float32, bfloat16 or float16, got {dtype}")
    return NativeKernel(spec, dtype)
