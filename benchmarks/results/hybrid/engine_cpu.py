"""A streamed decode token of the issue-30 model by each direct-read engine (--io-engine native: a C thread per read
in flight; uring: one C thread driving an io_uring): wall, process CPU (user / system), the model thread's CPU,
context switches, and the machine's steal time per token (/proc/stat: the hypervisor's time on our vCPUs). O_DIRECT,
no memory ceiling, --memory MEMORY, 40 warm-up tokens then 24 timed.

    .venv/bin/python benchmarks/results/hybrid/engine_cpu.py MODEL ENGINE [MEMORY] [WORKERS] [THREADS]

`engine-cpu.txt` runs it for both engines, rotated (the driver's loop is in that file's header).
"""
import resource
import sys
import time

import sluice
from sluice.engine import load

engine = sys.argv[2]
mem = sys.argv[3] if len(sys.argv) > 3 else "640MiB"
workers = int(sys.argv[4]) if len(sys.argv) > 4 else 8
threads = int(sys.argv[5]) if len(sys.argv) > 5 else 2


def steal() -> list[int]:
    """user, system, idle, iowait, softirq, steal: ticks of 10 ms, all CPUs"""
    v = open("/proc/stat").readline().split()
    return [int(v[i]) for i in (1, 3, 4, 5, 7, 8)]


m = load(sys.argv[1], memory=mem, io="direct", odirect=True, io_engine=engine, io_workers=workers, threads=threads,
         max_context=200)
ids = [5, 6]
list(m.generate_tokens(ids, max_tokens=40, temperature=0.0))
n = 24
s0, r0, c0, t0 = steal(), resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_THREAD), \
    time.perf_counter()
list(m.generate_tokens(ids, max_tokens=n, temperature=0.0))
w = (time.perf_counter() - t0) * 1000 / n
s1, r1, c1 = steal(), resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_THREAD)
st = [(b - a) * 10 / n for a, b in zip(s0, s1)]
print(f"{engine} x{workers} {mem} threads {threads}: {w:.1f} ms/token, CPU user {(r1.ru_utime - r0.ru_utime) * 1000 / n:.1f} "
      f"sys {(r1.ru_stime - r0.ru_stime) * 1000 / n:.1f}, model thread "
      f"{(c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime) * 1000 / n:.1f}, ctx switches vol "
      f"{(r1.ru_nvcsw - r0.ru_nvcsw) / n:.0f} invol {(r1.ru_nivcsw - r0.ru_nivcsw) / n:.0f}; machine per token: "
      + " ".join(f"{k} {x:.0f}" for k, x in zip(("user", "system", "idle", "iowait", "softirq", "steal"), st)))
