"""skip_ab.py's measurement one call at a time: in-process, four arms (the tracker as it is; routed, hits or noted a
no-op, a measurement only), each against "full" paired per round (benchmarks/common.py alternate_tokens, 16 timed
tokens an arm a round, order rotated), --memory 640MiB, O_DIRECT, --prefetch auto.

    .venv/bin/python benchmarks/results/hybrid/tracker-calls/skip_each_ab.py ROUNDS MODEL
"""
import sys, statistics
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
import sluice  # noqa
from benchmarks.common import alternate_tokens, decode_stream
from sluice.store.prefetch import PrefetchTracker
rounds, M = int(sys.argv[1]), sys.argv[2]
m, it = decode_stream(M, "auto")
orig = {k: getattr(PrefetchTracker, k) for k in ("routed", "hits", "noted")}
def arm(skip):
    def on():
        for k, f in orig.items(): setattr(PrefetchTracker, k, (lambda self, *a: None) if k == skip else f)
    return on
res = alternate_tokens(it, {"full": arm(None), "routed": arm("routed"), "hits": arm("hits"), "noted": arm("noted")}, rounds)
for k in ("routed", "hits", "noted"):
    d = [a - b for a, b in zip(res["full"], res[k])]
    print(f"skip {k}: paired {statistics.median(d):+.2f} ms, {sum(x > 0 for x in d)}/{len(d)}")
print("full median", statistics.median(res["full"]))
