"""The decode token's CPU by thread of the issue-30 model (/proc/self/task/*/stat: user and system ticks per thread over
80 tokens after 8, a 32-token prompt): the model's thread ("main"), the C pool's and torch's threads (their comm is
the process's, "python"), the direct reader's (sluice-io-N). stream: --memory 640MiB, O_DIRECT, no cgroup, --prefetch
none; router: the same with --prefetch router; resident: everything in memory (benchmarks/common.py decode_options).

    .venv/bin/python benchmarks/results/hybrid/thread_cpu.py router|stream|resident [MODEL]
"""
import sluice, torch, time, sys, os, collections
Q = sys.argv[2] if len(sys.argv) > 2 else "benchmarks/models/qwen3_5_moe-a3b-8GiB/model-Q4_K_M.gguf"
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))  # the repository root
from benchmarks.common import decode_options
m = sluice.load(Q, threads=2, max_context=300, **decode_options(sys.argv[1]))
def snap():
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:
            s = open(f"/proc/self/task/{t}/stat").read()
            name = open(f"/proc/self/task/{t}/comm").read().strip()
        except OSError: continue
        f = s[s.rindex(")")+2:].split()
        out[t] = (name, int(f[11]), int(f[12]))
    return out
ids = torch.randint(3, 32000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
g = m.generate_tokens(ids, max_tokens=88, temperature=0.0, stop_at_eos=False)
for i in range(8): next(g)
a = snap(); t = time.perf_counter()
for tok in g: pass
w = time.perf_counter() - t; b = snap()
hz = os.sysconf("SC_CLK_TCK"); n = 80
agg = collections.defaultdict(lambda: [0, 0, 0])
main = str(os.getpid())
for k, (nm, u, s) in b.items():
    if k not in a: continue
    du, ds = u - a[k][1], s - a[k][2]
    if du + ds == 0: continue
    key = "main" if k == main else nm
    agg[key][0] += du; agg[key][1] += ds; agg[key][2] += 1
print(sys.argv[1], f"{w/n*1e3:.1f} ms/token")
for k, (u, s, c) in sorted(agg.items(), key=lambda x: -(x[1][0]+x[1][1])):
    print(f"  {k:20s} x{c:2d} user {u/hz/n*1e3:6.2f} sys {s/hz/n*1e3:6.2f} ms/token")
