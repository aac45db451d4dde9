"""Resident prefill of a 2,048-token prompt with `--prefill-chunk auto` vs one 2,048-token chunk (issue 15): the
speed a whole-prompt chunk buys and the peak RSS it costs. Each setting loads the model afresh (peak RSS is per
process, so run the settings in separate processes to compare peaks fairly: `--chunk auto`, then `--chunk 2048`).

    PYTHONPATH=. .venv/bin/python benchmarks/prefill/chunk.py [GGUF] --chunk auto|N
"""

from __future__ import annotations

import argparse
import time

import torch

import sluice


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="benchmarks/models/qwen3_moe-peers/model-Q4_K_M.gguf")
    ap.add_argument("--chunk", default="auto", help="auto or a token count")
    ap.add_argument("--tokens", type=int, default=2048)
    a = ap.parse_args()
    chunk = a.chunk if a.chunk == "auto" else int(a.chunk)
    ids = torch.randint(0, 30000, (a.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    with sluice.load(a.model, memory="all", prefill_chunk=chunk) as m:
        m.replay(ids[:64], [])  # warm-up
        t = time.perf_counter()
        m.replay(ids, [])
        dt = time.perf_counter() - t
        print(f"chunk {m.prefill_chunk}: {dt:.1f} s = {a.tokens / dt:.1f} tok/s, "
              f"peak RSS {m.stats()['peak_rss_bytes'] / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
