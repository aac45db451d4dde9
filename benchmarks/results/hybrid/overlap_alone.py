"""DecodeExperts' start / finish alone (quant/native/moe_decode.py): a layer of 8 random experts of the issue-30
model's shape (Q4_K gate / up [256, 512], Q6_K down) plus a shared one, 2 native threads; per round the whole call
(run) timed, then start, a busy-wait of WINDOW us on this thread (what the model does there: queue the next
layer's reads), and finish timed: the medians of 200 calls each. Where the pool's workers get the window's CPU,
finish takes what is left after their share of the gate and up rows.

    PYTHONPATH=. .venv/bin/python benchmarks/results/hybrid/overlap_alone.py
"""
import time

import sluice  # noqa: F401 - before torch (its OpenMP threads)
import torch

from sluice.quant.native import pool
from sluice.quant.native.moe_decode import DecodeExperts
from tests.quant.test_moe_decode import _layer

pool.set_threads(2)
raw, call, extra, H = _layer(16)
k = 8
ex = DecodeExperts(call, extra, None, k, 1)
ex.check_raw(raw)
x = torch.randn(1, H).bfloat16()
w = torch.softmax(torch.randn(1, k), -1).bfloat16()
at, out, slots = torch.arange(k), torch.empty(1, H, dtype=torch.bfloat16), list(range(0, 16, 2))


def busy(us: float) -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < us * 1e-6:
        pass


for _ in range(2):
    for window in (0, 100, 200, 400):
        whole, rest = [], []
        for _ in range(200):
            busy(300)
            t0 = time.perf_counter()
            ex.run(raw, slots, list(range(k)), x, True, True, k, w, at, out)
            whole.append(time.perf_counter() - t0)
            busy(300)
            ex.start(raw, slots, x, w, at, out)
            busy(window)
            t1 = time.perf_counter()
            ex.finish()
            rest.append(time.perf_counter() - t1)
        print(f"window {window:3d} us: run {sorted(whole)[100] * 1e6:6.1f} us, finish after the window "
              f"{sorted(rest)[100] * 1e6:6.1f} us")
