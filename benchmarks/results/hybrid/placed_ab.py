"""In-process A/B of NativeStream.placed (store/stream_native.py) listing the guess's ids only on an error (now)
against listing its whole int32 scratch array every call (before: `self._in2.tolist()`, one entry per slot), on one
model's greedy stream after [5, 6] (40 tokens skipped): each round, each arm switched on, one token untimed, 16 timed,
arm order rotated per round (benchmarks/common.py alternate_tokens). --memory 640MiB, O_DIRECT, no cgroup, --prefetch
auto. Also times the two calls alone (1,000 each) after the stream's last token.

    .venv/bin/python benchmarks/results/hybrid/placed_ab.py ROUNDS MODEL
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

import sluice  # noqa: F401 - before torch (its OpenMP threads)
from benchmarks.common import alternate_tokens, decode_stream, print_paired
from sluice.store.stream_native import NativeStream

rounds, M = int(sys.argv[1]), sys.argv[2]
m, it = decode_stream(M, "auto")
now = NativeStream.placed


def before(self):
    self._in2.tolist()  # what placed() listed each call before (for an error message only)
    return now(self)


res = alternate_tokens(it, {"before": lambda: setattr(NativeStream, "placed", before),
                            "now": lambda: setattr(NativeStream, "placed", now)}, rounds)
print_paired(res, "before", "now", "auto placed {arm}", "now")
st = m.store._stream
print(f"slots (in2's length): {len(st._in2)}")
for name, f in (("before", before), ("now", now)):
    t = time.perf_counter()
    for _ in range(1000):
        f(st)
    print(f"placed() alone, {name}: {(time.perf_counter() - t) * 1e3:.2f} us a call")
it.close()
m.close()
