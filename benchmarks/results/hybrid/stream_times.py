"""Where a streamed decode layer's C calls of the store spend their time (store/stream.c), measured inside them:
stream_times.patch adds clock_gettime around the slot table's placement, the evicted keys' landing and the reads'
submission of a guess (wall, and the thread's CPU for the submission), and around an acquire's placement and counts.
Not part of sluice: apply, build, run, then revert.

    git apply benchmarks/results/hybrid/stream_times.patch && .venv/bin/python setup.py build_ext --inplace
    .venv/bin/python benchmarks/results/hybrid/stream_times.py MODEL        # 192 tokens after 8, --prefetch auto
    git checkout sluice/store/stream.c && .venv/bin/python setup.py build_ext --inplace
"""
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

import sluice
import torch
from benchmarks.common import decode_options
from sluice.store.slot_table import LIB

m = sluice.load(sys.argv[1], threads=2, max_context=400, **decode_options("auto"))
ids = torch.randint(3, 32000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
g = m.generate_tokens(ids, max_tokens=200, temperature=0.0, stop_at_eos=False)
for _ in range(8):
    next(g)
out = (ctypes.c_double * 16)()
LIB.sluice_stream_times(out)
t0 = list(out)
n = sum(1 for _ in g)
LIB.sluice_stream_times(out)
d = [b - a for a, b in zip(t0, out)]
p, a = d[8], d[11]
print(f"a guess's prefetch ({p / n:.1f} a token): placement {d[0] / p:.1f} us, evicted keys landed {d[1] / p:.1f} us, "
      f"reads submitted {d[2] / p:.1f} us wall, {d[6] / p:.1f} us CPU ({d[10] / p:.1f} batches)")
print(f"an acquire ({a / n:.1f} a token): placement {d[3] / a:.1f} us, counts {d[4] / a:.1f} us, whole call "
      f"{d[5] / a:.1f} us")
m.close()
