"""In-process A/B: a streamed decode's next-layer guess queued while the layer's experts start on the native pool's
other threads (sluice_experts_q8_start / _join, layers/moe.py Experts._native's `guess`) against queued inside the
acquire before the experts' one blocking call (the way before), on the issue-30 model, switched every 16 tokens of
one greedy run (benchmarks/common.py alternate_tokens: arm order rotated per round, one token after each switch
untimed). Streamed at --memory 640MiB, O_DIRECT, no cgroup, --prefetch auto (the default: router's guesses here).

    .venv/bin/python benchmarks/results/hybrid/guess_overlap_ab.py [ROUNDS] [MODEL]
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

import sluice
from benchmarks.common import alternate_tokens
from sluice.models.layers.experts import GluMath
from sluice.store.streaming import StreamingExpertStore

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 16
M = sys.argv[2] if len(sys.argv) > 2 else "benchmarks/models/qwen3_5_moe-a3b-8GiB/model-Q4_K_M.gguf"
acquire, many = StreamingExpertStore.acquire, GluMath.many


def sync_acquire(self, layer, experts, hold_guess=False):  # the guess queued at once, as before
    return acquire(self, layer, experts)


def sync_many(self, batch, js, x, ys, extra=None, during=None):  # one blocking call (`during` has nothing left)
    if during is not None:
        during()
    many(self, batch, js, x, ys, extra)


def setf(on: bool) -> None:
    StreamingExpertStore.acquire = acquire if on else sync_acquire
    GluMath.many = many if on else sync_many


m = sluice.load(M, threads=2, max_context=1200, memory="640MiB", io="direct", odirect=True)
print(f"{M}: prefetch {m.load_plan.prefetch}")
it = m.generate_tokens([5, 6], max_tokens=1100, temperature=0.0, stop_at_eos=False)
for _ in range(40):
    next(it)
res = alternate_tokens(it, {False: lambda: setf(False), True: lambda: setf(True)}, rounds)
for on in (True, False):
    v = res[on]
    print(f"{'overlapped' if on else 'before'}: median {statistics.median(v):.2f} ms/token, min {min(v):.2f}, "
          f"mean {statistics.mean(v):.2f}")
it.close()
d = [a - b for a, b in zip(res[True], res[False])]
print(f"paired diff (overlapped - before): median {statistics.median(d):+.2f} ms, {sum(x < 0 for x in d)}/{len(d)} "
      "rounds faster")
st = m.store.stats()
print(f"prefetch issued {st['prefetch_issued']} used {st['prefetch_used']} paused {st['prefetch_paused']}")
