"""A decode token of the issue-30 model with the native pool's wait between jobs set to (spin us, yield us)
(quant/native/pool.c sluice_set_spin, native/pool.py set_wait; the default is 50 us of spinning, then sched_yield up
to 1,000 us resident, 100 us streamed, then sleep):
wall, process CPU and the model thread's CPU per token, and context switches. MEMORY: a streamed budget (O_DIRECT,
no ceiling), or `all` (resident).

    .venv/bin/python benchmarks/results/hybrid/pool_spin.py MODEL SPIN_US YIELD_US [MEMORY]

`spin-avx2.txt` runs it for four settings, rotated, 4 rounds each (the driver's loop is in that file's header).
"""
import sys, time, resource
import sluice
from sluice.engine import load
from sluice.quant.native import pool
spin, yld = int(sys.argv[2]), int(sys.argv[3])
# the model applies its wait when it runs (engine.py, native/pool.py set_wait): this one, whether it streams or not
pool.SPIN_NS, pool.WAIT_RESIDENT_NS, pool.WAIT_STREAMED_NS = spin * 1000, yld * 1000, yld * 1000
mem = sys.argv[4] if len(sys.argv) > 4 else "640MiB"
m = load(sys.argv[1], memory=mem, io="direct", odirect=True, threads=2, max_context=200) if mem != "all" else load(sys.argv[1], memory="all", threads=2, max_context=200)
ids = [5, 6]
list(m.generate_tokens(ids, max_tokens=40, temperature=0.0))
n = 24
r0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
list(m.generate_tokens(ids, max_tokens=n, temperature=0.0))
w = (time.perf_counter() - t0) * 1000 / n
r1, c1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_THREAD)
cpu = lambda a, b: (b.ru_utime + b.ru_stime - a.ru_utime - a.ru_stime) * 1000 / n
print(f"{mem}: spin {spin} us yield {yld} us: {w:.1f} ms/token, CPU {cpu(r0, r1):.1f}, caller {cpu(c0, c1):.1f}, ctx switches vol {(r1.ru_nvcsw - r0.ru_nvcsw)/n:.0f} invol {(r1.ru_nivcsw - r0.ru_nivcsw)/n:.0f}")
