"""In-process A/B of the native pool's wait between jobs (native/pool.py set_wait) on a streamed decode of the
issue-30 model: wait A ns against wait B ns, switched every 16 tokens of one greedy run (arm order rotated per round,
one token after each switch untimed). --memory 640MiB, O_DIRECT, no cgroup, --prefetch none; `router`: --prefetch
router (benchmarks/common.py decode_options).

    .venv/bin/python benchmarks/results/hybrid/pool_wait_ab.py stream|router ROUNDS A B [MODEL]
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

from benchmarks.common import HYBRID_Q4, alternate_tokens, decode_stream
from sluice.quant.native import pool

mode, rounds, a, b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
M = sys.argv[5] if len(sys.argv) > 5 else HYBRID_Q4
m, it = decode_stream(M, mode)
res = alternate_tokens(it, {b: lambda: pool.set_wait(b), a: lambda: pool.set_wait(a)}, rounds)
it.close()
for w in (a, b):
    print(f"{mode} wait {w} ns: median {statistics.median(res[w]):.2f} ms/token, min {min(res[w]):.2f}")
d = [x - y for x, y in zip(res[a], res[b])]
print(f"paired ({a} - {b}): median {statistics.median(d):+.2f} ms, {sum(x < 0 for x in d)}/{len(d)} rounds faster with {a}")
