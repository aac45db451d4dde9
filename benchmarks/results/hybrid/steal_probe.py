"""The machine's CPU split (/proc/stat: user, system, idle, iowait, softirq, steal) per decode token of the issue-30
Q4_K_M model, streamed (--memory 640MiB, O_DIRECT, no ceiling) or resident; 8 warm-up tokens, 40 timed.

    .venv/bin/python benchmarks/results/hybrid/steal_probe.py stream|resident

Output: steal-probe.txt."""
import sys, time, resource
import sluice
Q = "benchmarks/models/qwen3_5_moe-a3b-8GiB/model-Q4_K_M.gguf"
mode = sys.argv[1]
def stat():
    v = list(map(int, open("/proc/stat").readline().split()[1:9]))
    return v  # user nice system idle iowait irq softirq steal (ticks of 10 ms)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))  # the repository root
from benchmarks.common import decode_options
m = sluice.load(Q, threads=2, max_context=200, **decode_options(mode))  # stream: --prefetch none
ids, n = [5, 6], 40
list(m.generate_tokens(ids, max_tokens=8, temperature=0.0))
s0, c0, t0 = stat(), cpu(), time.perf_counter()
list(m.generate_tokens(ids, max_tokens=n, temperature=0.0))
s1, c1, t1 = stat(), cpu(), time.perf_counter()
d = [(b - a) * 10 / n for a, b in zip(s0, s1)]
print(f"{mode}: {(t1-t0)*1000/n:.1f} ms/token, process CPU {(c1-c0)*1000/n:.1f}; system ms/token: " +
      " ".join(f"{k} {x:.1f}" for k, x in zip("user nice system idle iowait irq softirq steal".split(), d)))
