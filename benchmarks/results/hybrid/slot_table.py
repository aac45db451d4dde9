"""The streaming store's slot table alone (store/slot_table.py), Python (PolicySlots over FairShareLFU) against C
(NativeSlots, slots.c): us per call of a decode's acquire (8 routed experts of 256), its used() and the next layer's
guess (8 experts), on the issue-30/32 model's shape (40 MoE layers, 256 experts, top-8) with 1,800 slots, random
routing, 60 tokens, alternated 3 rounds. Both make the same choices (tests/store/test_slot_table.py).

    .venv/bin/python benchmarks/results/hybrid/slot_table.py
"""
import random, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import numpy as np
from sluice.store.policy import FairShareLFU
from sluice.store.slot_table import NativeSlots, PolicySlots

LAYERS, EXPERTS, TOP_K, SLOTS = 40, 256, 8, 1800
for rnd in range(3):
    for native in (False, True):
        t = (NativeSlots(range(LAYERS), LAYERS, EXPERTS, TOP_K, SLOTS) if native
             else PolicySlots(FairShareLFU(range(LAYERS), EXPERTS, TOP_K, SLOTS), SLOTS))
        t.count_into(np.zeros((LAYERS, EXPERTS), dtype=np.int64))
        rng = random.Random(0)
        ta = tu = tp = 0.0
        n = 0
        for tok in range(60):
            for L in range(LAYERS):
                ids = rng.sample(range(EXPERTS), TOP_K)
                t0 = time.perf_counter()
                _, missed, _ = t.acquire(L, ids)
                t1 = time.perf_counter()
                t.used(L, ids, missed)
                t2 = time.perf_counter()
                if L + 1 < LAYERS:
                    t.prefetch(L + 1, rng.sample(range(EXPERTS), TOP_K))
                t3 = time.perf_counter()
                t.unpin_all()
                ta, tu, tp, n = ta + t1 - t0, tu + t2 - t1, tp + t3 - t2, n + 1
        print(f"round {rnd} {'C     ' if native else 'Python'} acquire {ta / n * 1e6:5.1f} us  used {tu / n * 1e6:4.1f} us"
              f"  guess {tp / n * 1e6:5.1f} us  ({n} acquires, {len(t)} cached)")
