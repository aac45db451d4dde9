"""Resident decode with the integer kernels' activations in one int8 plane (llama.cpp's scheme) vs two (sluice's
default), alternated in one process (issue 14): does the second plane's accuracy cost time end to end?

    PYTHONPATH=. .venv/bin/python benchmarks/q8_planes.py [GGUF] [--rounds 4]

Default GGUF: the peers model's Q4_K_M file (benchmarks/quantized/run.sh makes it). Prints per-round medians of the
decode step times (16 teacher-forced tokens after a 32-token prompt) and the median over rounds for each setting.
"""

from __future__ import annotations

import argparse
import statistics

import sluice
from sluice.quant import native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="benchmarks/models/qwen3_moe-peers/model-Q4_K_M.gguf")
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    prompt, tokens = list(range(100, 132)), list(range(200, 216))
    with sluice.load(a.model, memory="all") as m:
        m.replay(prompt, tokens[:4])  # warm-up
        ms: dict[int, list[float]] = {1: [], 2: []}
        for r in range(a.rounds):
            for planes in ((1, 2) if r % 2 == 0 else (2, 1)):  # alternate which goes first
                native.Q8_PLANES = planes
                m.replay(prompt, tokens)
                ms[planes].append(1000 * statistics.median(m.step_times.decode_s))
    for planes, v in ms.items():
        print(f"{planes} plane(s): ms/token by round {[round(x, 1) for x in v]}, median {statistics.median(v):.1f}")


if __name__ == "__main__":
    main()
