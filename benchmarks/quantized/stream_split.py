"""Where a streamed decode step of a quantized GGUF spends its main thread (issue 14): the store's acquire (victims,
read plans, submits), the reader's submits alone, and the native expert calls, ms per token over 16 teacher-forced
steps after a one-token prompt, twice. Reads go to the disk (O_DIRECT), no memory ceiling needed.

    PYTHONPATH=. .venv/bin/python benchmarks/quantized/stream_split.py [GGUF] [--memory 640MiB]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import sluice
from sluice.io.direct import DirectReader
from sluice.quant.native import ExpertCall
from sluice.store.streaming import StreamingExpertStore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="benchmarks/models/qwen3_moe-6GiB-i512/model-Q4_K_M.gguf")
    ap.add_argument("--memory", default="640MiB")
    a = ap.parse_args()
    spent, calls = collections.Counter(), collections.Counter()

    def timed(cls, name: str, key: str) -> None:
        fn = getattr(cls, name)

        def wrapper(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[key] += time.perf_counter() - t
                calls[key] += 1

        setattr(cls, name, wrapper)

    timed(StreamingExpertStore, "acquire", "acquire")
    timed(DirectReader, "submit", "submit")
    timed(ExpertCall, "many", "experts")
    prompt, tokens = [100], list(range(200, 216))
    with sluice.load(a.model, memory=a.memory, io="direct", odirect=True, threads=2) as m:
        m.replay(prompt, tokens[:3])
        for _ in range(2):
            spent.clear()
            calls.clear()
            m.replay(prompt, tokens)
            n = len(tokens)
            print(f"decode {1000 * statistics.median(m.step_times.decode_s):.1f} ms/token; "
                  + ", ".join(f"{k} {1000 * v / n:.1f} ms ({calls[k] / n:.0f} calls)" for k, v in spent.items()))


if __name__ == "__main__":
    main()
