"""In-process A/B of how the io_uring reader's thread and the pool's workers are scheduled on a streamed decode (one
model's greedy stream after [5, 6], 40 tokens skipped; each round, each arm switched on, one token untimed, 16 timed,
arm order rotated: benchmarks/common.py alternate_tokens). --memory 640MiB, O_DIRECT, --prefetch auto. KIND:

    nice N      the reader's threads at nice 0 against nice N (os.setpriority; N < 0 needs CAP_SYS_NICE)
    affinity    every thread on both cores against the model's thread on core 0 and the reader's on core 1
    spin S W    the pool's workers spinning 50 us then yielding until 100 us after a job (a streamed model's wait,
                quant/native/pool.py) against spinning S us then yielding until W us

    .venv/bin/python benchmarks/results/hybrid/io_sched_ab.py ROUNDS MODEL KIND [ARGS]
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

import sluice  # noqa: F401 - before torch (its OpenMP threads)
from benchmarks.common import alternate_tokens, decode_stream, print_paired
from sluice.quant.native._lib import LIB

rounds, M, kind, args = int(sys.argv[1]), sys.argv[2], sys.argv[3], [int(a) for a in sys.argv[4:]]
m, it = decode_stream(M, "auto")
pid = os.getpid()
names = {int(t): open(f"/proc/{pid}/task/{t}/comm").read().strip() for t in os.listdir(f"/proc/{pid}/task")}
io = [t for t, n in names.items() if n.startswith("sluice-io")]
print("threads:", names)


def nice(v):
    def f():
        for t in io:
            os.setpriority(os.PRIO_PROCESS, t, v)
    return f


def spread():
    for t in names:
        os.sched_setaffinity(t, {0, 1})


def split():
    spread()
    os.sched_setaffinity(pid, {0})
    for t in io:
        os.sched_setaffinity(t, {1})


def spin(s_us, w_us):
    return lambda: LIB.sluice_set_spin(s_us * 1000, w_us * 1000)


if kind == "nice":
    arms = {"nice0": nice(0), f"nice{args[0]}": nice(args[0])}
elif kind == "affinity":
    arms = {"free": spread, "split": split}
elif kind == "spin":
    arms = {"spin50/100": spin(50, 100), f"spin{args[0]}/{args[1]}": spin(*args)}
else:
    raise SystemExit(f"KIND: nice, affinity or spin, not {kind!r}")
a, b = arms
res = alternate_tokens(it, arms, rounds)
print_paired(res, a, b, "auto {arm}", b)
(nice(0) if kind == "nice" else spread if kind == "affinity" else spin(50, 100))()
it.close()
m.close()
