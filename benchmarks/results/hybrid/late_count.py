"""Counts of a streamed decode token's DecodeExperts calls (start: a layer whose experts were all in memory at
acquire; run: the late path's calls, and a layer with no guess to queue), 80 tokens after 8 of a 32-token prompt,
--prefetch auto.

    .venv/bin/python benchmarks/results/hybrid/late_count.py MODEL
"""
import sys, collections
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import sluice, torch
from benchmarks.common import decode_options
import sluice.quant.native.moe_decode as MD
calls = collections.Counter()
for name in ("run", "start"):
    f = getattr(MD.DecodeExperts, name)
    def g(self, *a, _f=f, _n=name, **k):
        calls[_n] += 1
        return _f(self, *a, **k)
    setattr(MD.DecodeExperts, name, g)
m = sluice.load(sys.argv[1], threads=2, max_context=400, **decode_options("auto"))
ids = torch.randint(3, 32000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
g = m.generate_tokens(ids, max_tokens=88, temperature=0.0, stop_at_eos=False)
for i in range(8): next(g)
calls.clear()
n = sum(1 for _ in g)
print({k: v / n for k, v in calls.items()}, "per token")
