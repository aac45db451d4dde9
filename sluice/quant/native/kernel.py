"""The native kernels behind kernel_for's interface: a slot holds the stored bytes, `linear` picks the faster of the
row kernel and (native dequantization into the float32 scratch + one float32 matmul) by the number of rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import Kernel
from . import dequantize, linear, shared_pool, supports

# Rows (tokens of one expert) up to which the native row kernel runs; above it the weights are dequantized natively
# into the float32 scratch (bitwise the reference weights) and torch's float32 matmul runs, whose blocking keeps x
# in cache where the row kernel re-reads it per output row. One [768 x 2048] projection, ms (row kernel /
# dequantize + matmul), one thread, thread CPU time, median of 11 interleaved rounds, dev VM at load ~10
# (benchmarks/results/native_kernels.md):
#   Q4_K  T=16 2.30 / 3.14   T=24 3.18 / 3.91   T=32 4.00 / 4.18   T=48 6.12 / 4.75   T=64 8.18 / 5.39
#   Q8_0  T=16 1.62 / 2.21   T=24 2.30 / 2.42   T=32 3.06 / 3.05   T=48 4.63 / 3.50   T=64 6.73 / 4.37
#   MLX4  T=16 1.65 / 2.33   T=24 2.36 / 2.99   T=32 3.08 / 3.16   T=48 5.20 / 4.44   T=64 6.62 / 4.59
# so the crossover is at ~32 rows for every format measured (an earlier run at load 6 agreed: 32 < it < 64).
NATIVE_MAX_ROWS = 32


class NativeKernel(Kernel):
    """kernel_for's Kernel for a format native.supports: name "native", the slot holds the stored bytes
    (nbytes = spec.nbytes, prepare is a copy), linear(x, slot, scratch) -> y in the compute dtype."""

    name = "native"

    def _parts(self):
        return self.spec.parts, self.spec.nbytes

    def _prepare(self, raw, slot):
        slot[: self.nbytes].copy_(raw[: self.nbytes])

    def dequantize(self, slot, scratch):
        return dequantize(self.spec, slot[: self.nbytes], scratch[: self.scratch_numel])

    def linear(self, x, slot, scratch):
        # per call ~20 us of Python around the C call (was 155 before the checks' fast paths): each step is
        # skipped when it would be a no-op
        if x.dtype is not torch.float32:
            x = x.float()  # [T, in]
        if not x.is_contiguous():
            x = x.contiguous()
        if slot.numel() != self.nbytes:
            slot = slot[: self.nbytes]
        if x.shape[0] <= NATIVE_MAX_ROWS:
            pool = shared_pool()
            # native.set_threads(n > 1): the output rows split over n threads, the same bits
            y = linear(self.spec, x, slot) if pool is None else pool.linear(self.spec, x, slot)
        else:
            y = F.linear(x, self.dequantize(slot, scratch))
        return y if self.dtype is torch.float32 else y.to(self.dtype)


def native_kernel(spec, dtype: torch.dtype) -> NativeKernel:
    """The native kernel for spec at compute dtype (float32 / bfloat16 / float16); ValueError for a format the
    native kernels do not compute (check native.supports first)."""
    if not supports(spec):
        raise ValueError(f"the native kernels do not compute {spec.family} {spec.name}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"compute dtype must be float32, bfloat16 or float16, got {dtype}")
    return NativeKernel(spec, dtype)
