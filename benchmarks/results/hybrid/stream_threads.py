"""Per-thread CPU of a streamed decode step on the issue-30 model (benchmarks/hybrid/run.sh makes it): --memory 640MiB,
--io direct with O_DIRECT, no ceiling, 2 threads; 8 untimed tokens, then 40 timed; /proc/self/task's utime + stime per
thread (main = the calling thread; the others by thread id: 8 readers and the native pool's worker). Optional
arguments SPIN YIELD set the pool workers' wait after a job (pool.c sluice_set_spin, ns; default 50000 1000000).

    .venv/bin/python benchmarks/results/hybrid/stream_threads.py [SPIN YIELD]
"""
import os, time, sys, sluice, torch
Q = "benchmarks/models/qwen3_5_moe-a3b-8GiB/model-Q4_K_M.gguf"
opts = dict(memory="640MiB", io="direct", odirect=True, prefetch="none")  # no guesses: the default before 2026-12-05
m = sluice.load(Q, threads=2, max_context=200, **opts)
ids = [5, 6]
import ctypes
from sluice.quant.native._lib import LIB
if len(sys.argv) > 2:
    LIB.sluice_set_spin(ctypes.c_int64(int(sys.argv[1])), ctypes.c_int64(int(sys.argv[2])))
list(m.generate_tokens(ids, max_tokens=8, temperature=0.0))
def snap():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
            f = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            out[tid] = (name, (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"))
        except FileNotFoundError:
            pass
    return out
a = snap(); t = time.perf_counter(); n = 40
list(m.generate_tokens(ids, max_tokens=n, temperature=0.0))
wall = time.perf_counter() - t; b = snap()
agg = {}
for tid, (name, cpu) in b.items():
    d = cpu - a.get(tid, (name, 0))[1]
    key = "main" if tid == str(os.getpid()) else tid
    agg[key] = agg.get(key, 0) + d
print(sys.argv[1:], f"{wall / n * 1000:.1f} ms/token", "total CPU %.1f" % (sum(agg.values()) / n * 1000))
for k, v in sorted(agg.items(), key=lambda kv: -kv[1]):
    print(f"  {k:24s} {v / n * 1000:7.1f} ms CPU/token")
