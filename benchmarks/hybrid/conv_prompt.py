"""The Gated DeltaNet conv of a 2,048-token prompt layer (delta_prompt.c sluice_conv_prompt) in the hybrid
benchmark model's shape: q|k|v of 16 key / 32 value heads of 128 (8,192 channels), kernel 4, bf16, the input a slice
of the wider projection output as in the model; 2 threads, median and min of 10 after 2 untimed. The output is saved
to OUT (default /tmp/conv_out.pt) so two builds can be compared bit for bit.

    .venv/bin/python benchmarks/hybrid/conv_prompt.py [OUT]
"""

from __future__ import annotations

import statistics
import sys
import time

import sluice  # noqa: F401  (before torch: torch's OpenMP workers must not spin, sluice/__init__.py)
import torch


def main() -> None:
    from sluice.host.cpus import cpu_line, describe_cpu
    from sluice.quant.native import pool
    from sluice.quant.native.delta_prompt import DeltaRulePrompt

    print("CPU", cpu_line(describe_cpu()))
    torch.manual_seed(0)
    pool.set_threads(2)
    d = DeltaRulePrompt(16, 32, 128, 128, torch.bfloat16)
    C = 16 * 128 * 2 + 32 * 128
    qkv = torch.randn(2048, C + 4096 + 64).bfloat16()[:, :C]  # [T, C], rows as wide as the model's projections
    w = torch.randn(C, 1, 4).bfloat16()
    ts = []
    for _ in range(12):
        st = torch.zeros(C, 3).bfloat16()
        t = time.perf_counter()
        out = d.conv(qkv, w, st)
        ts.append(time.perf_counter() - t)
    print(f"conv 2048 x {C}: median {1e3 * statistics.median(ts[2:]):.2f} ms, min {1e3 * min(ts[2:]):.2f}")
    torch.save(out, sys.argv[1] if len(sys.argv) > 1 else "/tmp/conv_out.pt")


if __name__ == "__main__":
    sys.exit(main())
