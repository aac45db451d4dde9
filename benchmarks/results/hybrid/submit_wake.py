"""What one streamed layer's read hand-off costs the model's thread: DirectReader.submit_templates of 7 experts' reads
(3 ranges of 84 KiB each, O_DIRECT, at random 512-byte-aligned offsets of FILE: the issue-30 model's Q4_K_M experts'
shape), timed around the call alone, then the reads awaited, 400 layers; with the second CPU idle, and beside a
thread computing on it (a float32 matmul loop, the GIL released) as a decode step's kernels keep both CPUs busy.
Prints the median and mean microseconds of the call, and of the submit + wait.

    PYTHONPATH=. .venv/bin/python benchmarks/results/hybrid/submit_wake.py FILE [native|uring]
"""
import os
import random
import sys
import threading
import time

import numpy as np
import torch

from sluice.io.direct import DirectReader
from sluice.io.ranges import ReadRange

path, engine = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "native")
size = os.path.getsize(path)
rng = random.Random(0)
part, experts, layers = 84 * 1024, 7, 400
buf = np.zeros((experts * 3 * part + 4096,), dtype=np.uint8)
base = (-buf.ctypes.data) % 4096
view = memoryview(buf)[base:]
r = DirectReader(8, odirect=True, engine=engine)


def layer_items():
    items = []
    for e in range(experts):
        reqs = []
        for p in range(3):
            off = rng.randrange(0, size - part) // 512 * 512
            at = (e * 3 + p) * part
            reqs.append((ReadRange(path, off, part), view[at : at + part]))
        items.append((r.template(reqs, buf.ctypes.data + base), buf.ctypes.data + base))
    return items


plans = [layer_items() for _ in range(layers)]
stop = False


def spin():
    a = torch.randn(256, 256)
    while not stop:
        a @ a


for busy in (False, True):
    th = None
    if busy:
        torch.set_num_threads(1)
        th = threading.Thread(target=spin, daemon=True)
        th.start()
        time.sleep(0.2)
    call, total = [], []
    for items in plans:
        t0 = time.perf_counter()
        futs = r.submit_templates(items)
        t1 = time.perf_counter()
        for f in futs:
            f.result()
        call.append(t1 - t0)
        total.append(time.perf_counter() - t0)
    stop = True
    if th:
        th.join()
    stop = False
    c, t = np.array(call) * 1e6, np.array(total) * 1e6
    print(f"{engine} {'busy' if busy else 'idle'}: submit_templates median {np.median(c):.0f} us, mean {c.mean():.0f}; "
          f"with the reads median {np.median(t):.0f} us ({layers} layers of {experts} x 3 reads of {part // 1024} KiB)")
r.close()
