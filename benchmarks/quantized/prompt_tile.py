"""One prompt projection on prompt.c's tiles alone: a Q4_K [512 x 1024] matrix of the peers Q4_K_M file (layer 3's
expert gate rows) times T bf16 rows (default 256, about one expert's share of a 2,048-token prompt), coded once at
one plane (int8), on the AVX2 tiles and on the best this CPU has (AVX512-VNNI where present), 1 and 2 threads; the
best of 10 calls after 3 untimed.

    .venv/bin/python benchmarks/quantized/prompt_tile.py [T]
"""

from __future__ import annotations

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

    print("CPU", cpu_line(describe_cpu()))
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    N, K = 512, 1024
    t = next(t for t in GGUFReader(MODEL).tensors if t.name == "blk.3.ffn_gate_exps.weight")
    raw = torch.from_numpy(np.array(t.data).reshape(-1).view(np.uint8)[: N * 576].copy())
    spec = QuantSpec.ggml("Q4_K", N, K)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(0)).bfloat16()
    y = torch.empty(T, N)
    for threads in (1, 2):
        pool.set_threads(threads)
        for path, name in ((AVX2, "avx2"), (BEST, "best")):
            for _ in range(3):
                prompt.linears([(spec, raw, y)], x, planes=1, path=path)
            best = 1e9
            for _ in range(10):
                t0 = time.perf_counter()
                prompt.linears([(spec, raw, y)], x, planes=1, path=path)
                best = min(best, time.perf_counter() - t0)
            print(f"threads {threads} {name} T {T}: {1e3 * best:.2f} ms, {N * K * T / best / 1e9:.1f} GMAC/s")


if __name__ == "__main__":
    sys.exit(main())
