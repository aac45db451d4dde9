"""In-process A/B of the streaming store's slot table on a streamed decode: two models of the same file loaded side by
side, one whose stores keep their slots in Python (store/slot_table.py PolicySlots over FairShareLFU, the way before
slots.c) and one in C (NativeSlots, the default), each its own greedy stream after [5, 6] (40 tokens skipped), 16
timed tokens of one then of the other (one untimed after each switch), arm order rotated per round, so both see the
same machine moments. The two make the same choices (tests/store/test_slot_table.py): the same reads, hits and
tokens. --memory 640MiB, O_DIRECT, no cgroup; MODE as benchmarks/common.py decode_options (auto: --prefetch auto).

    .venv/bin/python benchmarks/results/hybrid/slot_ab.py auto ROUNDS [MODEL]
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

import sluice  # noqa: F401 - before torch (its OpenMP threads)
import sluice.store.streaming as streaming
from benchmarks.common import HYBRID_Q4, alternate, decode_stream, timed_tokens
from sluice.store.policy import FairShareLFU
from sluice.store.slot_table import PolicySlots, make_table

mode, rounds = sys.argv[1], int(sys.argv[2])
M = sys.argv[3] if len(sys.argv) > 3 else HYBRID_Q4


def python_table(layers, n_layers, num_experts, top_k, slots, policy=None):
    return PolicySlots(policy or FairShareLFU(layers, num_experts, top_k, slots), slots)


streaming.make_table = python_table
mp, ip = decode_stream(M, mode)
streaming.make_table = make_table
mc, ic = decode_stream(M, mode)
res = alternate({"python": lambda: timed_tokens(ip), "C": lambda: timed_tokens(ic)}, rounds)
for w in ("python", "C"):
    print(f"{mode} {w}: median {statistics.median(res[w]):.2f} ms/token, min {min(res[w]):.2f}")
d = [x - y for x, y in zip(res["python"], res["C"])]
print(f"paired (python - C): median {statistics.median(d):+.2f} ms, {sum(x > 0 for x in d)}/{len(d)} rounds faster "
      "with C")
for m, it in ((mp, ip), (mc, ic)):
    it.close()
    m.close()
