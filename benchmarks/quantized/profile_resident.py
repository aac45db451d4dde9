"""Where a resident decode of a quantized GGUF spends its time (issue 14): decode ms/token, then a cProfile of 32
teacher-forced tokens after a one-token prompt (so nearly all of it is decode) sorted by own time.

    PYTHONPATH=. .venv/bin/python benchmarks/quantized/profile_resident.py [GGUF] [--lines 18]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics

import sluice


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="benchmarks/models/qwen3_moe-peers/model-Q4_K_M.gguf")
    ap.add_argument("--lines", type=int, default=18)
    a = ap.parse_args()
    prompt, tokens = [100], list(range(200, 232))
    with sluice.load(a.model, memory="all") as m:
        m.replay(prompt, tokens[:4])  # warm-up
        m.replay(prompt, tokens)
        print(f"decode ms/token: median {1000 * statistics.median(m.step_times.decode_s):.1f}, "
              f"mean {1000 * statistics.fmean(m.step_times.decode_s):.1f}, threads {m.stats()['threads']}")
        prof = cProfile.Profile()
        prof.runcall(m.replay, prompt, tokens)
    pstats.Stats(prof).sort_stats("tottime").print_stats(a.lines)


if __name__ == "__main__":
    main()
