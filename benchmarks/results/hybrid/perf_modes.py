"""Whole-process perf profiles of a greedy decode in two modes, for their differences by symbol: the model loaded
as benchmarks/common.py decode_options(MODE) says (resident: everything in memory; auto: --memory 640MiB, O_DIRECT,
--prefetch auto), 2 threads, a 32-token random prompt, 8 tokens untimed, then `perf record -F 4999` (no call graphs)
on this process over the next 160 tokens.

    .venv/bin/python benchmarks/results/hybrid/perf_modes.py MODE MODEL OUT.data
    perf report -i OUT.data --no-children --sort comm,dso -n --stdio
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

import sluice  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import decode_options  # noqa: E402

m = sluice.load(sys.argv[2], threads=2, max_context=300, **decode_options(sys.argv[1]))
ids = torch.randint(3, 32000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
g = m.generate_tokens(ids, max_tokens=168, temperature=0.0, stop_at_eos=False)
for _ in range(8):
    next(g)
p = subprocess.Popen(["perf", "record", "-F", "4999", "-p", str(os.getpid()), "-o", sys.argv[3]],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(1.0)
t, n = time.perf_counter(), 0
for _ in g:
    n += 1
w = time.perf_counter() - t
p.send_signal(signal.SIGINT)
p.wait()
print(sys.argv[1], f"{w / n * 1e3:.1f} ms/token over {n}")
