"""In-process A/B of the direct reader's engine (--io-engine A against B: native = preader.c's 8 threads, uring = one
thread driving an io_uring) on a streamed decode: two models of the same file loaded side by side, one per engine,
each its own greedy stream after [5, 6] (40 tokens skipped), 16 timed tokens of one then of the other (one untimed
after each switch), arm order rotated per round, so both see the same machine moments. --memory 640MiB, O_DIRECT,
no cgroup; MODE stream (--prefetch none), router, or auto (the default read-ahead) (benchmarks/common.py
decode_options). MODE prompt: each round one 512-token prompt (random ids, the same for both arms) through each
model at the default read-ahead, timed whole (tok/s).

    .venv/bin/python benchmarks/results/hybrid/engine_ab.py auto|router|stream|prompt ROUNDS native uring [MODEL]
    (an arm "uring16": the io_uring with 16 reads in flight, --io-workers 16; engine_opts)
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

import sluice
from benchmarks.common import HYBRID_Q4, alternate, decode_options, decode_stream, timed_tokens

mode, rounds, a, b = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
M = sys.argv[5] if len(sys.argv) > 5 else HYBRID_Q4
PROMPT = 512


def engine_opts(arm: str) -> dict:
    """An arm's reader: "native" or "uring" at their default depths (the io_uring's 16 since 21a9d12, 8 before:
    engine-ab.txt's runs), or with a depth, "uring8", "uring16", "native16" (--io-workers N)."""
    name = arm.rstrip("0123456789")
    return dict(io_engine=name, io_workers=int(arm[len(name):])) if arm != name else dict(io_engine=arm)


def prompts(m, seeds):
    def run() -> float:
        ids = torch.randint(3, 32000, (PROMPT,), generator=torch.Generator().manual_seed(next(seeds))).tolist()
        t = time.perf_counter()
        m.logits(ids)
        return PROMPT / (time.perf_counter() - t)
    return run


if mode == "prompt":
    import itertools
    import torch
    opts = decode_options("auto")
    ma = sluice.load(M, threads=2, max_context=PROMPT + 8, **engine_opts(a), **opts)
    mb = sluice.load(M, threads=2, max_context=PROMPT + 8, **engine_opts(b), **opts)
    ma.logits([5, 6]), mb.logits([5, 6])
    sa, sb = itertools.count(), itertools.count()  # the same prompts in the same order for both
    res = alternate({a: prompts(ma, sa), b: prompts(mb, sb)}, rounds)
    for w in (a, b):
        print(f"prompt {w}: median {statistics.median(res[w]):.1f} tok/s, max {max(res[w]):.1f}")
    d = [x - y for x, y in zip(res[a], res[b])]
    print(f"paired ({a} - {b}): median {statistics.median(d):+.1f} tok/s, {sum(x > 0 for x in d)}/{len(d)} rounds "
          f"faster with {a}")
    ma.close(), mb.close()
    sys.exit(0)
(ma, ia), (mb, ib) = decode_stream(M, mode, **engine_opts(a)), decode_stream(M, mode, **engine_opts(b))
res = alternate({a: lambda: timed_tokens(ia), b: lambda: timed_tokens(ib)}, rounds)
for w in (a, b):
    print(f"{mode} {w}: median {statistics.median(res[w]):.2f} ms/token, min {min(res[w]):.2f}")
d = [x - y for x, y in zip(res[a], res[b])]
print(f"paired ({a} - {b}): median {statistics.median(d):+.2f} ms, {sum(x < 0 for x in d)}/{len(d)} rounds faster "
      f"with {a}")
for m, it in ((ma, ia), (mb, ib)):
    it.close()
    m.close()
