"""How much the prefetch tracker's per-layer calls cost in a streamed decode step: in-process A/B of
PrefetchTracker.routed, hits and noted as they are ("full") against the three as no-ops ("skip": the counters and the
throttle's window then go stale; only a measurement), on one model's greedy stream after [5, 6] (40 tokens skipped),
--memory 640MiB, O_DIRECT, --prefetch auto (benchmarks/common.py alternate_tokens: one untimed and 16 timed tokens per
arm per round, order rotated).

    .venv/bin/python benchmarks/results/hybrid/tracker-calls/skip_ab.py ROUNDS MODEL
"""
import sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
import sluice  # noqa
from benchmarks.common import alternate_tokens, decode_stream, print_paired
from sluice.store.prefetch import PrefetchTracker
rounds, M = int(sys.argv[1]), sys.argv[2]
m, it = decode_stream(M, "auto")
orig = {k: getattr(PrefetchTracker, k) for k in ("routed", "hits", "noted")}
def on():
    for k, f in orig.items(): setattr(PrefetchTracker, k, f)
def skip():
    for k in orig: setattr(PrefetchTracker, k, lambda self, *a: None)
res = alternate_tokens(it, {"full": on, "skip": skip}, rounds)
print_paired(res, "full", "skip", "auto {arm}", "skip")
