"""The streaming store's calls of a decode layer alone, no model math: a guess's prefetch (issued as the decode block
issues it, after the acquire pinned the layer's experts), the acquire of the true experts, each waited for, release;
the model thread's CPU (time.thread_time: not its waits) and wall per layer, the C path (store/stream_native.py)
against the Python path, in alternating rounds on one store each (two models of the same file side by side, so both
see the same machine moments). The ids: each token's 40 layers routed as a real greedy stream routed them (recorded
first), the guess the true ids of the layer (a right guess, as ~99% of the UD file's are), a sleep of SLEEP seconds
(default 0.0005) after each layer standing for its math (the guessed reads land meanwhile, as in the model). --memory
640MiB, O_DIRECT.

    .venv/bin/python benchmarks/results/hybrid/stream_calls.py ROUNDS MODEL [SLEEP]
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

import sluice  # noqa: F401 - before torch (its OpenMP threads)
from benchmarks.common import decode_stream

rounds, M = int(sys.argv[1]), sys.argv[2]
SLEEP = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0005
routes = []  # (layer, ids) in the order the decode asked
ma, ia = decode_stream(M, "auto", skip=8)
real = ma.store.acquire


def record(layer, experts, hold=False):
    routes.append((layer, list(experts)))
    return real(layer, experts, hold)


ma.store.acquire = record
for _ in range(24):
    next(ia)
ma.store.acquire = real
ia.close()
mb, ib = decode_stream(M, "auto", skip=8)
ib.close()
mb.store._land_stream()
mb.store._stream = False  # Python's path
layers = sorted({L for L, _ in routes})
nxt = {L: layers[(i + 1) % len(layers)] for i, L in enumerate(layers)}
guess = {}  # the next layer's true ids, as issued after each acquire
for i, (L, ids) in enumerate(routes[:-1]):
    guess[i] = routes[i + 1]


def cycle(store) -> tuple[float, float]:
    t, c = time.perf_counter(), time.thread_time()
    for i, (L, ids) in enumerate(routes):
        batch = store.acquire(L, ids, hold=True)
        if i in guess:
            store.prefetch_next(*guess[i])
            store.issue_deferred()
        batch.wait_all()
        store.release(L)
        time.sleep(SLEEP)  # the layer's math: the guessed reads land meanwhile (not the model thread's CPU)
    n = len(routes)
    return (time.perf_counter() - t) / n * 1e6, (time.thread_time() - c) / n * 1e6


res = {"python": [], "C": []}
for r in range(rounds):
    for arm in (("python", "C") if r % 2 == 0 else ("C", "python")):
        res[arm].append(cycle(mb.store if arm == "python" else ma.store))
for arm in ("python", "C"):
    w, c = zip(*res[arm])
    print(f"{arm:6s}: {len(routes)} layer calls a round; wall {statistics.median(w):6.1f} us a layer "
          f"(min {min(w):.1f}), model thread CPU {statistics.median(c):6.1f} us (min {min(c):.1f})")
d = [p[1] - q[1] for p, q in zip(res["python"], res["C"])]
print(f"paired CPU (python - C): median {statistics.median(d):+.1f} us a layer, "
      f"{sum(x > 0 for x in d)}/{len(d)} rounds")
sa, sb = ma.store.stats(), mb.store.stats()
print("C:", {k: sa[k] for k in ("hits", "misses", "prefetch_issued", "prefetch_used")})
print("python:", {k: sb[k] for k in ("hits", "misses", "prefetch_issued", "prefetch_used")})
ma.close()
mb.close()
