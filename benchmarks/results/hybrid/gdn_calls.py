"""Wall time of a decode token's Gated DeltaNet mixer calls (GatedDeltaNet.__call__, wrapped) over 80 tokens after 8
(a 32-token prompt), 2 threads, in the checkout at ROOT (so two checkouts' kernels compare in alternate processes);
MODE as benchmarks/common.py decode_options.

    .venv/bin/python benchmarks/results/hybrid/gdn_calls.py ROOT MODE MODEL
"""
import sys, time, collections
root = sys.argv[1]
sys.path.insert(0, root)
import sluice, torch
from benchmarks.common import decode_options
import sluice.models.layers.gated_deltanet as GD
acc = collections.Counter(); calls = collections.Counter()
def wrap(cls, name):
    f = getattr(cls, name)
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: acc[cls.__name__] += time.perf_counter() - t; calls[cls.__name__] += 1
    setattr(cls, name, g)
wrap(GD.GatedDeltaNet, "__call__")
m = sluice.load(sys.argv[3], threads=2, max_context=300, **decode_options(sys.argv[2]))
ids = torch.randint(3, 32000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
g = m.generate_tokens(ids, max_tokens=88, temperature=0.0, stop_at_eos=False)
for i in range(8): next(g)
acc.clear(); calls.clear(); t = time.perf_counter()
for _ in range(80): next(g)
w = (time.perf_counter() - t) / 80
g.close(); m.close()
print(f"{w*1e3:.2f} ms/token; " + "; ".join(f"{k} {acc[k]/calls[k]*1e6:.1f} us/call ({acc[k]/80*1e3:.2f} ms/token)" for k in sorted(acc)))
