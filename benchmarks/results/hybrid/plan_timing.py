"""Planning a streamed expert's reads in C (io/plan.c): DirectReader.template_at one expert a call, and templates_at a
layer's 256 experts a call, on 2,560 expert-like batches of the issue-30 model's file (gate and up 72 KiB, down 105
KiB, at varied offsets), 8 workers, O_DIRECT; microseconds an expert.

    PYTHONPATH=. .venv/bin/python benchmarks/results/hybrid/plan_timing.py MODEL
"""
import sys
import time

from sluice.io import DirectReader
from sluice.io.ranges import ReadRange

path = sys.argv[1]
r = DirectReader(8, odirect=True)
batches = [[(ReadRange(path, 1_000_000 + 4096 * 97 * e + k * 300_000, 73728 if k < 2 else 107520),
             (0, 73728, 147456)[k]) for k in range(3)] for e in range(2560)]
for rnd in range(3):
    t = time.perf_counter()
    for b in batches:
        r.template_at(b)
    one = (time.perf_counter() - t) / len(batches) * 1e6
    t = time.perf_counter()
    for L in range(0, len(batches), 256):
        r.templates_at(batches[L : L + 256])
    many = (time.perf_counter() - t) / len(batches) * 1e6
    print(f"round {rnd + 1}: template_at {one:.1f} us an expert, templates_at (256 a call) {many:.1f} us an expert")
r.close()
