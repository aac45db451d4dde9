"""Per-thread user / system CPU and context switches a token (/proc/self/task/*), 80 decode tokens after 8, 2 threads;
MODE as benchmarks/common.py decode_options.

    .venv/bin/python benchmarks/results/hybrid/io-batch/threads.py auto MODEL
"""
import sys, time, os
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repository root
import sluice, torch
from benchmarks.common import decode_options
def snap():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            st = open(f"/proc/self/task/{tid}/stat").read()
            name = st[st.index("(")+1:st.rindex(")")]
            f = st[st.rindex(")")+2:].split()
            ut, stt = int(f[11]), int(f[12])
            d = dict(l.split(":\t") for l in open(f"/proc/self/task/{tid}/status").read().splitlines() if ":\t" in l)
            out[tid] = (name, ut, stt, int(d["voluntary_ctxt_switches"]), int(d["nonvoluntary_ctxt_switches"]))
        except FileNotFoundError: pass
    return out
m = sluice.load(sys.argv[2], threads=2, max_context=300, **decode_options(sys.argv[1]))
ids = torch.randint(3, 32000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
g = m.generate_tokens(ids, max_tokens=88, temperature=0.0, stop_at_eos=False)
for i in range(8): next(g)
a = snap(); t = time.perf_counter()
for tok in g: pass
w = time.perf_counter() - t; b = snap(); n = 80
print(sys.argv[1], f"{w/n*1e3:.1f} ms/token")
for tid in sorted(b, key=int):
    if tid in a:
        na, u0, s0, v0, i0 = a[tid]; _, u1, s1, v1, i1 = b[tid]
        if u1-u0+s1-s0+v1-v0 > 0:
            print(f"  {tid} {na:16s} user {(u1-u0)*10/n:6.2f} sys {(s1-s0)*10/n:6.2f} ms/token  vcsw {(v1-v0)/n:7.1f} ivcsw {(i1-i0)/n:6.1f} /token")
