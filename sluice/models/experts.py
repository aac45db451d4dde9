"""The routed experts' math from slot bytes: SwiGLU y = down(act(gate x) * up x) for one expert.

Plain experts (BF16/F16/F32) run F.linear on typed views of the slots, gate and up as one [2I, H] matrix; quantized
experts run each projection from its stored bytes (quant/stored.py), with one float32 scratch reused by every call.
The same function serves the resident and the streaming store, so a streamed run computes bitwise what a resident
run computes on the same slots.

At decode the experts of one layer may run on several threads (`pool_for`): each expert's result is computed by one
thread with the same code whichever it is, and the caller sums them in a fixed order, so the output does not depend
on the threads or their timing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from ..quant.stored import StoredLinear


def rows_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) for x [n, in]; several rows of bf16/f16 run in float32 and are cast back.

    CPUs without native bf16 math (AVX2: this machine, most of the users') run torch's bf16 GEMM ~6x slower than a
    float32 GEMM including both conversions: [256 x 1024] @ [1024 x 448] then [256 x 224] @ [224 x 1024], 2
    threads: 27.9 ms bf16 vs 4.5 ms via float32 (T=32: 3.5 vs 1.7 ms). One row (decode) stays in the compute dtype.
    The rounding differs from a bf16 GEMM's (float32 accumulation, one rounding at the end); resident and streamed
    runs call the same function on the same shapes, so they stay bitwise equal.
    """
    if x.shape[0] > 1 and x.dtype in (torch.bfloat16, torch.float16):
        return F.linear(x.float(), w.float()).to(x.dtype)
    return F.linear(x, w)


class ExpertMath:
    """Expert forward passes for every storage format the layout holds, at one compute dtype."""

    # Off: a layer's native experts on a thread pool lost to one thread in a real decode. The peers model's Q4_K_M
    # file, resident, 2 CPUs, 16 tokens (quiet machine): 118 ms/token with the pool, 69.6 without it (torch keeps its
    # 2 OpenMP threads for the other ops), 93-101 on one thread: torch's OpenMP workers spin between ops and take
    # the pool's second core. Kept (bitwise the same result, tested) for when the rest of the step leaves torch.
    threads_for_experts = False

    def __init__(self, dtype: torch.dtype, act: Callable[[torch.Tensor], torch.Tensor]):
        self.dtype, self.act = dtype, act
        self._kernels: dict[object, tuple] = {}
        self._scratch_numel = 0  # the largest projection of any format seen; each thread has its own scratch
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_threads = 0

    def __call__(self, batch, j: int, x: torch.Tensor) -> torch.Tensor:
        """The j-th expert of `batch` (store/base.py ExpertBatch) on x [n, H] -> [n, H]."""
        slot = batch.slots[j]
        if batch.gate_up is not None:
            gu = batch.gate_up[slot]  # [2I, H]
            dn = batch.down[slot]  # [H, I]
            if gu.dtype != x.dtype:  # streamed slots keep the checkpoint dtype
                gu, dn = gu.to(x.dtype), dn.to(x.dtype)
            g, u = rows_linear(x, gu).chunk(2, dim=-1)  # [n, I] each
            return rows_linear(self.act(g) * u, dn)
        fmt, raw = batch.format, batch.raw[slot]
        gate_up, gate, up, down = self._kernels_for(fmt)
        scratch = self._scratch()
        if gate_up is not None:  # one call over the 2I rows of [gate; up]
            g, u = gate_up(x, raw[: fmt.up_offset + fmt.up.nbytes], scratch).chunk(2, dim=-1)  # [n, I] each
        else:
            g = gate(x, raw[: fmt.gate.nbytes], scratch)  # [n, I]
            u = up(x, raw[fmt.up_offset : fmt.up_offset + fmt.up.nbytes], scratch)  # [n, I]
        return down(self.act(g) * u, raw[fmt.down_offset : fmt.down_offset + fmt.down.nbytes], scratch)

    def pool_for(self, batch) -> ThreadPoolExecutor | None:
        """Threads to run this batch's experts on, or None for the calling thread alone.

        Only for experts stored quantized whose every projection runs the native kernels (single-threaded C that
        releases the GIL; the torch paths parallelise inside their matmuls instead), and only when torch may use
        more than one thread: torch.get_num_threads(), which the ThreadGovernor keeps at the CPUs other processes
        leave free, sizes the pool. Measured (benchmarks/native_kernels.py, 8 Q4_K [768 x 2048] experts at T=1):
        spread over 2 threads they cost 11.0 ms of CPU against 10.1 on one thread, so ~1.8x where two cores are
        free; the loaded dev VM (load ~10 on 2 cores) could not show it in wall time.
        """
        n = torch.get_num_threads()
        if not self.threads_for_experts or n < 2 or batch.gate_up is not None or batch.format is None:
            return None
        if not all(k is None or k.native is not None for k in self._kernels_for(batch.format)):
            return None
        if self._pool_threads != n:  # the governor changed torch's thread count
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool, self._pool_threads = ThreadPoolExecutor(n, thread_name_prefix="sluice-experts"), n
        return self._pool

    def _scratch(self) -> torch.Tensor:
        """This thread's float32 scratch (the torch paths and the native many-rows path write weights into it)."""
        s = getattr(self._local, "scratch", None)
        if s is None or s.numel() < self._scratch_numel:
            s = self._local.scratch = torch.empty(self._scratch_numel, dtype=torch.float32)
        return s

    def _kernels_for(self, fmt) -> tuple:
        """(gate_up or None, gate, up, down) StoredLinears of one ExpertFormat, built once."""
        k = self._kernels.get(fmt)
        if k is None:
            specs = (fmt.gate_up, fmt.gate, fmt.up, fmt.down)
            k = self._kernels[fmt] = tuple(None if s is None else StoredLinear(s, self.dtype) for s in specs)
            # sized once per format: each thread's scratch grows to it at its next expert
            self._scratch_numel = max(self._scratch_numel, *(x.scratch_numel for x in k if x is not None))
        return k
