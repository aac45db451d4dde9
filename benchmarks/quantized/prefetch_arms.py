"""Resident decode of a quantized GGUF with the integer path's software prefetch at several distances (q8.c
pf_bytes, native.set_prefetch; 0 = off), arms rotated in one process, for both activation codings: decode
ms/token (median of each replay's steps) per round, then the medians. The output bits do not depend on the
prefetch (checked here on the last replay of each arm).

    PYTHONPATH=. .venv/bin/python benchmarks/quantized/prefetch_arms.py [GGUF] [--rounds 5] [--tokens 48]
"""

from __future__ import annotations

import argparse
import statistics

import torch

import sluice
from sluice.quant import native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="benchmarks/models/qwen3_moe-peers/model-Q4_K_M.gguf")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--distances", default="0,1024,2048,4096", help="prefetch distances in bytes, comma-separated")
    a = ap.parse_args()
    prompt = [100, 101, 102, 103]
    tokens = torch.randint(200, 20000, (a.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    models = {act: sluice.load(a.model, memory="all", threads=2, activations=act) for act in ("int16", "int8")}
    arms = [(act, d) for act in models for d in map(int, a.distances.split(","))]
    times: dict[tuple, list[float]] = {arm: [] for arm in arms}
    logits: dict[tuple, torch.Tensor] = {}
    for m in models.values():
        m.replay(prompt, tokens[:4])  # warm-up
    for r in range(a.rounds):
        order = arms[r % len(arms):] + arms[: r % len(arms)]  # rotated
        for act, d in order:
            native.set_prefetch(d)
            m = models[act]
            m.replay(prompt, tokens)
            times[(act, d)].append(1000 * statistics.median(m.step_times.decode_s))
            if r == a.rounds - 1:
                with torch.inference_mode():
                    logits[(act, d)] = m.model.logits(m.model.forward(torch.tensor([tokens[0]]), len(prompt)))
        print(f"round {r}: " + ", ".join(f"{act}/{d} {times[(act, d)][-1]:.1f}" for act, d in arms), flush=True)
    native.set_prefetch(2048)
    for act, d in arms:
        same = torch.equal(logits[(act, d)], logits[(act, int(a.distances.split(",")[0]))])
        print(f"{act}, prefetch {d} B: median {statistics.median(times[(act, d)]):.1f} ms/token"
              f"{'' if same else ' (logits differ!)'}")
    for m in models.values():
        m.close()


if __name__ == "__main__":
    main()
