"""Resident decode of a GGUF with the decode step's threading on and off, in one process, arms alternated: on =
a layer's experts split over the native threads and torch on one thread for the step (Transformer.forward /
_native_decode); off = every expert on the calling thread, torch on its own threads (split_experts False).
Median ms/token of each replay of 48 teacher-forced tokens after a 32-token prompt.

    PYTHONPATH=. .venv/bin/python benchmarks/quantized/decode_threads.py [GGUF] [--rounds 4]
"""

from __future__ import annotations

import argparse
import statistics

import sluice


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="benchmarks/models/qwen3_moe-peers/model-Q4_K_M.gguf")
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    prompt, tokens = list(range(100, 132)), list(range(200, 248))
    with sluice.load(a.model, memory="all", threads=2) as m:
        m.replay(prompt, tokens[:4])  # warm-up
        res: dict[bool, list[float]] = {True: [], False: []}
        for r in range(a.rounds):
            for split in (True, False) if r % 2 == 0 else (False, True):
                m.model.split_experts = split
                m.replay(prompt, tokens)
                res[split].append(1000 * statistics.median(m.step_times.decode_s))
        for split, name in ((True, "split experts, torch 1 thread"), (False, "one thread experts, torch 2")):
            print(f"{name:32s} {[round(v, 1) for v in res[split]]} median {statistics.median(res[split]):.1f} ms/token")


if __name__ == "__main__":
    main()
