"""In-process A/B of the io_uring thread's scheduling: SCHED_OTHER at nice 0 (as sluice runs it) against SCHED_FIFO
priority 1 ("fifo": every wake-up preempts the compute threads at once; root only) or another nice value (KIND a
number), set on the thread named sluice-io-ring between arms. One model's greedy stream after [5, 6] (40 tokens
skipped), --memory 640MiB, O_DIRECT, --prefetch auto (benchmarks/common.py alternate_tokens: one untimed and 16 timed
tokens an arm a round, order rotated).

    .venv/bin/python benchmarks/results/hybrid/io_fifo_ab.py ROUNDS MODEL fifo|NICE
"""
import sys, os, glob
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import sluice  # noqa
from benchmarks.common import alternate_tokens, decode_stream, print_paired
rounds, M, kind = int(sys.argv[1]), sys.argv[2], sys.argv[3]
m, it = decode_stream(M, "auto")
tids = [int(p.split("/")[-2]) for p in glob.glob("/proc/self/task/*/comm") if open(p).read().strip() == "sluice-io-ring"]
print("io threads", tids)
def other():
    for t in tids: os.sched_setscheduler(t, os.SCHED_OTHER, os.sched_param(0)); os.setpriority(os.PRIO_PROCESS, t, 0)
def fast():
    for t in tids:
        if kind == "fifo": os.sched_setscheduler(t, os.SCHED_FIFO, os.sched_param(1))
        else: os.setpriority(os.PRIO_PROCESS, t, int(kind))
res = alternate_tokens(it, {"other": other, kind: fast}, rounds)
print_paired(res, "other", kind, "auto io thread {arm}", kind)
