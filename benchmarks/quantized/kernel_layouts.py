"""A decode token's 128 experts (16 layers x top-8 of 64, the peers shape: H 1024, I 512, random valid blocks, Q4_K
gate / up and a Q4_K or Q6_K down) through ExpertCall.many, the K-quants reading x in super-blocks of 256 (q8.c)
against the 32-value layout (native.set_super_blocks(False)), on 1 and 2 native threads: ms per token, median of 20,
arms alternated in one process.

    PYTHONPATH=. .venv/bin/python benchmarks/quantized/kernel_layouts.py [--rounds 3] [--experts 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sluice.quant import native
from sluice.quant.spec import QuantSpec
from tests.quant.samples import random_expert_slots
from sluice.store.layout import ExpertFormat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--experts", type=int, default=64, help="distinct experts cycled through (64: 54 MB, past L3)")
    a = ap.parse_args()
    H, I = 1024, 512
    for down in ("Q4_K", "Q6_K"):
        fmt = ExpertFormat.of(QuantSpec.ggml("Q4_K", I, H), QuantSpec.ggml("Q4_K", I, H), QuantSpec.ggml(down, H, I))
        slots = random_expert_slots(fmt, a.experts)
        call = native.ExpertCall((fmt.gate, fmt.up, fmt.down), (0, fmt.up_offset, fmt.down_offset))
        x, ys = torch.randn(1, H), torch.empty(8, H)
        for threads in (1, 2):
            native.set_threads(threads)
            res: dict[str, list[float]] = {"super-blocks": [], "32-blocks": []}
            for r in range(a.rounds):
                arms = list(res) if r % 2 == 0 else list(res)[::-1]
                for arm in arms:
                    native.set_super_blocks(arm == "super-blocks")
                    ts = []
                    for _ in range(20):
                        t0 = time.perf_counter()
                        for L in range(16):
                            call.many(slots, [(8 * L + j) % a.experts for j in range(8)], x, ys, list(range(8)))
                        ts.append(time.perf_counter() - t0)
                    res[arm].append(1000 * statistics.median(ts))
            native.set_super_blocks(True)
            print(f"down {down}, {threads} thread(s): " + ", ".join(
                f"{arm} {' '.join(f'{t:.1f}' for t in v)} ms" for arm, v in res.items()))
    native.set_threads(1)


if __name__ == "__main__":
    main()
