"""Cache-hot rates of the integer kernels on this CPU: 8 Q4_K experts of the peers shape (H 1024, I 512; gate, up,
down; 12.6M weights, 7 MB) in one ExpertCall.many call, against one [12288 x 1024] Q4_K projection of the same
weight count through LinearsQ8, on 1 and 2 native threads: us per call, mean of 300, 3 rounds.

    PYTHONPATH=. .venv/bin/python benchmarks/quantized/kernel_rates.py
"""

from __future__ import annotations

import time

import torch

from sluice.quant import native
from sluice.quant.spec import QuantSpec
from tests.quant.samples import random_expert_slots, random_stored
from sluice.store.layout import ExpertFormat


def main() -> None:
    H, I = 1024, 512
    fmt = ExpertFormat.of(QuantSpec.ggml("Q4_K", I, H), QuantSpec.ggml("Q4_K", I, H), QuantSpec.ggml("Q4_K", H, I))
    slots = random_expert_slots(fmt, 8)
    call = native.ExpertCall((fmt.gate, fmt.up, fmt.down), (0, fmt.up_offset, fmt.down_offset))
    big = QuantSpec.ggml("Q4_K", 12 * I * 2, H)  # as many weights as the 8 experts
    lin = native.LinearsQ8([(big, random_stored(big))])
    x, ys = torch.randn(1, H), torch.empty(8, H)
    for threads in (1, 2):
        native.set_threads(threads)
        for r in range(3):
            t0 = time.perf_counter()
            for _ in range(300):
                call.many(slots, list(range(8)), x, ys, list(range(8)))
            a = (time.perf_counter() - t0) / 300 * 1e6
            t0 = time.perf_counter()
            for _ in range(300):
                lin(x)
            b = (time.perf_counter() - t0) / 300 * 1e6
            print(f"{threads} thread(s), round {r}: 8 experts {a:.0f} us ({12.6e6 / a / 1e3:.1f} G weights/s), "
                  f"one [12288 x 1024] projection {b:.0f} us ({12.6e6 / b / 1e3:.1f} G weights/s)")
    native.set_threads(1)


if __name__ == "__main__":
    main()
