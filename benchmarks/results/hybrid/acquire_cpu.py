"""Where the streaming store's acquire spends the model's thread, per decode token: wall and thread CPU of
store.acquire and of what it calls (the reader's submission, the eviction choice), on the issue-30 model streamed
without a ceiling (O_DIRECT: every miss goes to the disk), 2 threads. Works on checkouts before and after read
templates (it times whichever of reader.submit_each / store._submit / reader.submit_templates exists).

    PYTHONPATH=CHECKOUT .venv/bin/python benchmarks/results/hybrid/acquire_cpu.py [MODEL] [--memory 640MiB]
        [--warmup 48] [--tokens 40]

The warm-up is long so that most experts were read once before the timed tokens (a store plans an expert's reads
at its first miss; 48 tokens touch ~78% of the 256 experts of each layer at 8 a token).
"""

from __future__ import annotations

import argparse
import functools
import time

import sluice  # before torch
from sluice.engine import load

ap = argparse.ArgumentParser()
ap.add_argument("model", nargs="?", default="benchmarks/models/qwen3_5_moe-a3b-8GiB/model-Q4_K_M.gguf")
ap.add_argument("--memory", default="640MiB")
ap.add_argument("--warmup", type=int, default=48)
ap.add_argument("--tokens", type=int, default=40)
a = ap.parse_args()
m = load(a.model, memory=a.memory, io="direct", odirect=True, prefetch="none", threads=2,
         max_context=a.warmup + a.tokens + 16)
acc: dict[str, list[float]] = {}


def timed(obj, name: str) -> None:
    if not hasattr(obj, name):
        return
    f, acc[name] = getattr(obj, name), [0.0, 0.0, 0]

    @functools.wraps(f)
    def g(*args, **kw):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return f(*args, **kw)
        finally:
            x = acc[name]
            x[0] += time.perf_counter() - t
            x[1] += time.thread_time() - c
            x[2] += 1

    setattr(obj, name, g)


timed(m.store, "acquire")
timed(m.store, "_submit")
timed(m.reader, "submit_each")
timed(m.reader, "submit_templates")
timed(m.store, "_victim")
ids = [5, 6]
list(m.generate_tokens(ids, max_tokens=a.warmup, temperature=0.0))
for v in acc.values():
    v[:] = [0.0, 0.0, 0]
c0, t0 = time.thread_time(), time.perf_counter()
out = list(m.generate_tokens(ids, max_tokens=a.tokens, temperature=0.0))
n = len(out)
wall, cpu = (time.perf_counter() - t0) * 1000 / n, (time.thread_time() - c0) * 1000 / n
print(f"{sluice.__file__}: {wall:.1f} ms/token, model thread CPU {cpu:.1f} ms/token; per token, wall / CPU ms "
      "(calls): " + ", ".join(f"{k} {v[0] * 1000 / n:.2f} / {v[1] * 1000 / n:.2f} ({v[2] / n:.0f})"
                              for k, v in acc.items() if v[2]))
