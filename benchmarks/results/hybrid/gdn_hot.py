"""One Gated DeltaNet layer's decode call (DeltaNetFused: projections, conv, rule, norm, out_proj) in a hot loop, the
layer's weights in cache, in the checkout at ROOT (two checkouts' kernels compare in alternate processes): best and
median of 15 x 200 calls, 2 threads, resident.

    .venv/bin/python benchmarks/results/hybrid/gdn_hot.py ROOT MODEL
"""
import sys, time
root = sys.argv[1]
sys.path.insert(0, root)
import sluice, torch
from sluice.models.layers.gated_deltanet import GatedDeltaNet
m = sluice.load(sys.argv[2], threads=2, max_context=300, memory="all")
layers = [l.mixer for l in m.model.layers if isinstance(getattr(l, "mixer", None), GatedDeltaNet)]
g = layers[0]
x = torch.randn(1, m.spec.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
f = g.fused
ts = []
with torch.inference_mode():
    for _ in range(200): f(x)
    for _ in range(15):
        t = time.perf_counter()
        for _ in range(200): f(x)
        ts.append((time.perf_counter() - t) / 200)
ts.sort()
print(f"{root}: one layer's DeltaNetFused call, best {ts[0]*1e6:.1f} us, median {ts[len(ts)//2]*1e6:.1f} us (15 x 200 calls)")
