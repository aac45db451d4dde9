"""perf_step.sh's table: a `perf record -g` file's samples per thread (the busiest four), each thread's by leaf
symbol, and its share in three groups: the native kernels (sluice's _kernels library), Python (libpython), the rest
(the kernel, torch, libc, ...).

    .venv/bin/python benchmarks/results/hybrid/perf_threads.py PERF.DATA [TOP]
"""
import collections
import subprocess
import sys

out = subprocess.run(["perf", "script", "-i", sys.argv[1], "-F", "tid,ip,sym,dso"], capture_output=True,
                     text=True, check=True).stdout
samples, cur = [], None
for line in out.splitlines():
    if not line.strip():
        if cur:
            samples.append(cur)
        cur = None
    elif not line.startswith("\t"):  # a sample's header: its tid (perf may pad it with spaces)
        cur = (int(line.split()[0]), [])
    elif cur is not None:
        parts = line.strip().split(None, 1)
        cur[1].append(parts[1] if len(parts) > 1 else "?")
if cur:
    samples.append(cur)
total = len(samples)
print(f"samples {total} (999 Hz a CPU)")
for tid, n in collections.Counter(t for t, _ in samples).most_common(4):
    leaves = collections.Counter(fr[0] if fr else "?" for t, fr in samples if t == tid)
    groups = collections.Counter("kernels" if "_kernels" in s else "python" if "libpython" in s else "other"
                                 for s in leaves.elements())
    print(f"== thread {tid}: {n} samples ({100 * n / total:.1f}%); " +
          ", ".join(f"{g} {100 * k / n:.1f}%" for g, k in groups.most_common()))
    for s, k in leaves.most_common(int(sys.argv[2]) if len(sys.argv) > 2 else 25):
        print(f"   {100 * k / n:5.1f}%  {s}")
