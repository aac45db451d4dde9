"""A 2,048-token prompt layer's causal attention of the peers model's shape (8 query / 2 kv heads of 128, bf16) on
attend_avx2.c (float32 products and probabilities) against torch's SDPA on the same bf16 inputs (what a model on
float32 GEMMs ran before), 1 and 2 threads, medians of 7 after 2 untimed, and each one's relative error against a
float64 reference on the first 256 rows.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        .venv/bin/python benchmarks/quantized/attend_avx2.py
"""

from __future__ import annotations

import statistics
import sys
import time

import sluice  # noqa: F401  (before torch: torch's OpenMP workers must not spin, sluice/__init__.py)
import torch
import torch.nn.functional as F


def main() -> None:
    from sluice.host.cpus import cpu_line, describe_cpu
    from sluice.quant.native import attend, pool

    print("CPU", cpu_line(describe_cpu()))
    g = torch.Generator().manual_seed(0)
    T, nh, nkv, d = 2048, 8, 2, 128
    q = (torch.randn(nh, T, d, generator=g) * 2).bfloat16()
    k = (torch.randn(nkv, T, d, generator=g) * 2).bfloat16()
    v = torch.randn(nkv, T, d, generator=g).bfloat16()
    runs = {"attend_avx2.c": lambda: attend.causal(q, k, v, 0, float32=True),
            "torch SDPA, bf16 inputs": lambda: F.scaled_dot_product_attention(
                q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0].transpose(0, 1).reshape(T, -1)}
    exact = F.scaled_dot_product_attention(q[None, :, :256].double(), k[None, :, :256].double(),
                                           v[None, :, :256].double(), is_causal=True,
                                           enable_gqa=True)[0].transpose(0, 1).reshape(256, -1)
    for threads in (1, 2):
        pool.set_threads(threads)
        torch.set_num_threads(threads)
        for name, fn in runs.items():
            out = [fn() for _ in range(2)][-1]
            times = []
            for _ in range(7):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            err = float((out[:256].double() - exact).norm() / exact.norm())
            print(f"threads {threads} {name}: {1e3 * statistics.median(times):.1f} ms "
                  f"(min {1e3 * min(times):.1f}), relative error {err:.2e}")


if __name__ == "__main__":
    sys.exit(main())
