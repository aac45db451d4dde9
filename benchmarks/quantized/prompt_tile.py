"""One prompt projection on prompt.c's tiles alone: a Q4_K [512 x 1024] matrix of the peers Q4_K_M file (layer 3's
expert gate rows; another tensor's first expert or matrix with --tensor, e.g. blk.0.ffn_down_exps.weight, a Q6_K
[1024 x 512], or blk.3.attn_q.weight) times T bf16 rows (default 256, about one expert's share of a 2,048-token
prompt), coded once at one plane (int8), on the AVX2 tiles and on the best this CPU has (AVX512-VNNI where present),
1 and 2 threads; the best and the median of 10 calls after 3 untimed.

    .venv/bin/python benchmarks/quantized/prompt_tile.py [T] [--tensor NAME]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import sluice  # noqa: F401  (before torch: torch's OpenMP workers must not spin, sluice/__init__.py)
import numpy as np
import torch

MODEL = Path(__file__).resolve().parents[1] / "models/qwen3_moe-peers/model-Q4_K_M.gguf"


def main() -> None:
    from gguf import GGUFReader

    from sluice.host.cpus import cpu_line, describe_cpu
    from sluice.quant.native import AVX2, BEST, pool, prompt
    from sluice.quant.spec import QuantSpec

    ap = argparse.ArgumentParser()
    ap.add_argument("T", type=int, nargs="?", default=256)
    ap.add_argument("--tensor", default="blk.3.ffn_gate_exps.weight")
    a = ap.parse_args()
    print("CPU", cpu_line(describe_cpu()))
    T = a.T
    t = next(t for t in GGUFReader(MODEL).tensors if t.name == a.tensor)
    K, N = (int(n) for n in t.shape[:2])  # GGUF order: [K, N(, experts)]
    spec = QuantSpec.ggml(t.tensor_type.name, N, K)
    raw = torch.from_numpy(np.array(t.data).reshape(-1).view(np.uint8)[: spec.nbytes].copy())
    print(f"{a.tensor}: {spec.name} [{N} x {K}]")
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(0)).bfloat16()
    y = torch.empty(T, N)
    for threads in (1, 2):
        pool.set_threads(threads)
        for path, name in ((AVX2, "avx2"), (BEST, "best")):
            for _ in range(3):
                prompt.linears([(spec, raw, y)], x, planes=1, path=path)
            ts = []
            for _ in range(10):
                t0 = time.perf_counter()
                prompt.linears([(spec, raw, y)], x, planes=1, path=path)
                ts.append(time.perf_counter() - t0)
            best, med = min(ts), sorted(ts)[5]
            print(f"threads {threads} {name} T {T}: {1e3 * best:.2f} ms, {N * K * T / best / 1e9:.1f} GMAC/s "
                  f"(median {1e3 * med:.2f} ms, {N * K * T / med / 1e9:.1f})")


if __name__ == "__main__":
    sys.exit(main())
