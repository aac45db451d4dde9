"""PrefetchTracker.routed's body with fewer steps (the scoring as one set intersection, the window's outcomes in one
extend, one attribute store) against it as it is (the same state after each call), in process, paired per round
(benchmarks/common.py alternate_tokens), --memory 640MiB, O_DIRECT, --prefetch auto.

    .venv/bin/python benchmarks/results/hybrid/tracker-calls/routed_ab.py ROUNDS MODEL
"""
import sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
import sluice  # noqa
from benchmarks.common import alternate_tokens, decode_stream, print_paired
from sluice.store.prefetch import PrefetchTracker
rounds, M = int(sys.argv[1]), sys.argv[2]
m, it = decode_stream(M, "auto")
old = PrefetchTracker.routed
def new(self, layer, experts):
    predicted = self.predicted.pop(layer, None)
    if predicted is not None:
        self.true_total += len(experts)
        self.predicted_true += len(predicted.intersection(experts))
    guessed = self._guessed.pop(layer, None)
    if guessed:
        chosen = set(experts)
        hits = [e in chosen for e in guessed]
        out = self._outcomes
        out.extend(hits)
        right = self._right + hits.count(True)
        for _ in range(len(out) - self.throttle.window):
            right -= out.popleft()
        self._right = right
res = alternate_tokens(it, {"old": lambda: setattr(PrefetchTracker, "routed", old),
                            "new": lambda: setattr(PrefetchTracker, "routed", new)}, rounds)
print_paired(res, "old", "new", "auto routed {arm}", "new")
t = m.store.prefetching
print("right", t._right, "window", len(t._outcomes), "predicted_true", t.predicted_true, "true", t.true_total)
