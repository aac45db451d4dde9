"""A decode token's experts as one expert_q8 call each on one thread (Transformer.split_experts False,
native.set_threads(1)) vs one call per layer with their rows split over two native threads (ExpertCall.many,
pool.c), on a resident GGUF: ms for the 16 layers x top-k experts of one token (random x and ids), median of 20,
rounds alternated.

    PYTHONPATH=. .venv/bin/python benchmarks/quantized/expert_threads.py [GGUF] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import sluice
from sluice.quant import native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="benchmarks/models/qwen3_moe-peers/model-Q4_K_M.gguf")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    with sluice.load(a.model, memory="all", threads=2) as m:
        tm, s = m.model, m.spec
        g = torch.Generator().manual_seed(0)
        layers = [L for L in range(s.n_layers) if s.moe_layers[L]]
        xs = {L: torch.randn(1, s.hidden_size, generator=g).to(m.dtype) for L in layers}
        ids = {L: torch.randperm(s.num_experts, generator=g)[: s.top_k][None] for L in layers}
        w = torch.full((1, s.top_k), 1.0 / s.top_k)

        def token() -> None:
            for L in layers:
                tm._experts_one_token(L, xs[L], ids[L], w, torch.zeros(1, s.hidden_size, dtype=m.dtype))

        for r in range(a.rounds):
            arms = (("one thread", False), ("split", True))
            for name, split in arms if r % 2 == 0 else arms[::-1]:
                tm.split_experts = split
                native.set_threads(2 if split else 1)
                token()
                ts = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    token()
                    ts.append(time.perf_counter() - t0)
                print(f"round {r} {name:10s} {1000 * statistics.median(ts):6.2f} ms per token's experts")


if __name__ == "__main__":
    main()
