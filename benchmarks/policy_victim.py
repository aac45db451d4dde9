"""Cost of one eviction choice of the streaming store's default policy (store/policy.py FairShareLFU.victim) with
the 6 GiB benchmark model's cache: 31 MoE layers, 64 experts, ~600 slots, every layer at its share. Two cases: the
layer asking holds its share (it evicts one of its own), and a layer under its share with none above theirs (it
takes the globally least recent one, which once walked every slot).

    PYTHONPATH=. .venv/bin/python benchmarks/policy_victim.py
"""

from __future__ import annotations

import time

from sluice.store.policy import FairShareLFU


def per_call_us(fn, n: int = 5000) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    layers = list(range(31))
    p = FairShareLFU(layers, num_experts=64, top_k=8, slots=600)
    for L in layers:
        for e in range(p.quota):
            p.insert((L, e), L * 64 + e)
    usable = lambda key, slot: True  # noqa: E731
    full = per_call_us(lambda: p.victim(0, usable))
    p.remove((5, 0))
    under = per_call_us(lambda: p.victim(5, usable))
    print(f"{len(p)} slots, share {p.quota}: own share full {full:.1f} us per victim, under its share {under:.1f} us")


if __name__ == "__main__":
    main()
