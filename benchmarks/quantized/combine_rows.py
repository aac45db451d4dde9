"""A prompt's weighted sum of expert outputs alone (native/ops.c sluice_combine_rows_bf16): a 2,048-token layer of a
top-8, hidden-1024 model (the peers model's), its [T*K, H] bf16 expert rows landing in random order, the caches
flushed by a 64 MiB write before each call; 2 threads, the median of 30 calls.

    .venv/bin/python benchmarks/quantized/combine_rows.py
"""

from __future__ import annotations

import sys
import time

import sluice  # noqa: F401  (before torch: sluice/__init__.py)
import torch


def main() -> None:
    from sluice.host.cpus import cpu_line, describe_cpu
    from sluice.quant.native import BEST, ops, pool

    print("CPU", cpu_line(describe_cpu()))
    pool.set_threads(2)
    T, K, H = 2048, 8, 1024
    g = torch.Generator().manual_seed(0)
    ys = torch.randn(T * K, H, generator=g).bfloat16()
    w = torch.rand(T * K, generator=g).bfloat16()
    at = torch.randperm(T * K, generator=g).view(T, K)
    out = torch.empty(T, H, dtype=torch.bfloat16)
    ts = []
    for _ in range(30):
        torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
        t0 = time.perf_counter()
        ops.combine_rows_bf16(ys, w, at, out, path=BEST)
        ts.append(time.perf_counter() - t0)
    print(f"combine T {T} K {K} H {H}: median {1e3 * sorted(ts)[15]:.2f} ms, best {1e3 * min(ts):.2f}")


if __name__ == "__main__":
    sys.exit(main())
