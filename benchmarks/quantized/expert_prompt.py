"""One prompt expert call alone (prompt.expert on a layer's coded rows: gate and up Q4_K tiles, silu(g) * u coded
again, the down's tiles, bf16 rows out) on the peers Q4_K_M file's experts: layer 0 (Q6_K downs) and layer 2 (Q4_K
downs), T rows each (default 256, one expert's share of a 2,048-token prompt) drawn from 2,048 coded rows; "same
expert" repeats expert 0 (its bytes in cache), "64 experts" takes the layer's 64 in turn (their bytes from DRAM, as in
a prompt). 2 threads, the AVX2 tiles, the median of 7 passes over the 64 calls.

    .venv/bin/python benchmarks/quantized/expert_prompt.py [T]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import sluice  # noqa: F401  (before torch: sluice/__init__.py)
import numpy as np
import torch

MODEL = Path(__file__).resolve().parents[1] / "models/qwen3_moe-peers/model-Q4_K_M.gguf"


def main() -> None:
    from gguf import GGUFReader

    from sluice.host.cpus import cpu_line, describe_cpu
    from sluice.quant.native import AVX2, pool, prompt
    from sluice.quant.spec import QuantSpec

    print("CPU", cpu_line(describe_cpu()))
    reader = GGUFReader(MODEL)

    def experts(name: str, n: int, k: int) -> list:
        t = next(t for t in reader.tensors if t.name == name)
        spec = QuantSpec.ggml(t.tensor_type.name, n, k)
        a = torch.from_numpy(np.array(t.data).reshape(-1).view(np.uint8).copy())
        return [(spec, a[e * spec.nbytes : (e + 1) * spec.nbytes]) for e in range(64)]

    pool.set_threads(2)
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    for L in (0, 2):
        G, U = experts(f"blk.{L}.ffn_gate_exps.weight", 512, 1024), experts(f"blk.{L}.ffn_up_exps.weight", 512, 1024)
        D = experts(f"blk.{L}.ffn_down_exps.weight", 1024, 512)
        x = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(0)).bfloat16()
        coded = prompt.code(x, planes=1, path=AVX2)
        out = torch.empty(T, 1024, dtype=torch.bfloat16)
        rows = [torch.randperm(2048, generator=torch.Generator().manual_seed(e))[:T].sort().values for e in range(64)]
        for hot in (True, False):
            dts = []
            for _ in range(7):
                t0 = time.perf_counter()
                for e in range(64):
                    k = 0 if hot else e
                    prompt.expert(G[k], U[k], D[k], coded, out, rows=rows[e], planes=1, path=AVX2)
                dts.append(time.perf_counter() - t0)
            dt = sorted(dts)[3]
            print(f"L{L} ({D[0][0].name} down) {'same expert' if hot else '64 experts'} T {T}: {1e3 * dt / 64:.3f} ms a "
                  f"call, {3 * 512 * 1024 * T * 64 / dt / 1e9:.1f} GMAC/s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
