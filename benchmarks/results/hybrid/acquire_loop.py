"""A streamed store's acquire + release of one layer's 8 cached experts in a hot loop (no reads, no model math
between: the caches warm), after a short greedy decode (--prefetch auto, --memory 640MiB, O_DIRECT): the best of 5
rounds of 2,000 calls, the C path's NativeStream.acquire alone, and a cProfile of the loop's calls.

    .venv/bin/python benchmarks/results/hybrid/acquire_loop.py MODEL
"""
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

import sluice
import torch
from benchmarks.common import decode_options

m = sluice.load(sys.argv[1], threads=2, max_context=400, **decode_options("auto"))
ids = torch.randint(3, 32000, (8,), generator=torch.Generator().manual_seed(0)).tolist()
for _ in m.generate_tokens(ids, max_tokens=12, temperature=0.0, stop_at_eos=False):
    pass
st = m.store
L = m.layout.layers[3]
ex = sorted(e for (layer, e) in st.table if layer == L)[:8]
print(f"{len(ex)} cached experts of layer {L}; the C path: {st._fast() is not None}")


def run(n=2000):
    t = time.perf_counter()
    for _ in range(n):
        st.acquire(L, ex, hold=True)
        st.release(L)
    return (time.perf_counter() - t) / n * 1e6


run(200)
print(f"acquire + release: {min(run() for _ in range(5)):.1f} us a call (best of 5 x 2000)")
s = st._stream
t = time.perf_counter()
for _ in range(2000):
    s.acquire(L, ex, None)
print(f"NativeStream.acquire alone: {(time.perf_counter() - t) / 2000 * 1e6:.1f} us a call")
st.table.unpin_all()
prof = cProfile.Profile()
prof.runcall(run, 3000)
pstats.Stats(prof).sort_stats("tottime").print_stats(8)
m.close()
