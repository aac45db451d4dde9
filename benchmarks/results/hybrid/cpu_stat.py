"""Where a decode token's CPU goes, machine-wide (/proc/stat's user, system, idle, iowait, softirq, steal over 80
tokens after 8, a 32-token prompt, summed over the CPUs), 2 threads; MODE as benchmarks/common.py decode_options;
EXTRA: more sluice.load options as a Python dict literal (EXTRA="dict(io_engine='uring')").

    .venv/bin/python benchmarks/results/hybrid/cpu_stat.py router|resident|auto MODEL
"""
import sys, time, os
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common
import sluice, torch
from benchmarks.common import decode_options
def stat():
    f = open("/proc/stat").readline().split()[1:]
    return [int(x) for x in f]
m = sluice.load(sys.argv[2], threads=2, max_context=300, **decode_options(sys.argv[1]), **eval(os.environ.get("EXTRA", "{}")))
ids = torch.randint(3, 32000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
g = m.generate_tokens(ids, max_tokens=88, temperature=0.0, stop_at_eos=False)
for i in range(8): next(g)
a = stat(); t = time.perf_counter(); b0 = m.stats() if hasattr(m, "stats") else None
for tok in g: pass
w = time.perf_counter() - t; b = stat(); n = 80
names = "user nice system idle iowait irq softirq steal".split()
print(sys.argv[1], f"{w/n*1e3:.1f} ms/token;", " ".join(f"{k} {(b[i]-a[i])*10/n:.1f}" for i, k in enumerate(names)), "ms/token (all CPUs)")
