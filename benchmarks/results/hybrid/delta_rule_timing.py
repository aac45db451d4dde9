"""The chunked delta rule (models/layers/delta_rule.py `chunked`) at Qwen3.5 / 3.6's linear-attention shapes (32
value heads, 16 key heads tiled to them, 128 x 128 state), one 2,048-token prompt in DELTA_SLICE slices of 256, 2
threads: this tree's against another tree's (its delta_rule.py given as a file: `git show REV:sluice/models/layers/
delta_rule.py > old.py`), alternated, ms per layer, median of 5 rounds; and the largest difference of their bf16
outputs relative to the largest (bf16 rounding: in float32 both are 1.5e-6 from a float64 run).

    .venv/bin/python benchmarks/results/hybrid/delta_rule_timing.py old.py
"""

import importlib.util
import statistics
import sys
import time

import sluice  # noqa: F401  before torch, as the engine (OpenMP wait policy)
import torch

from sluice.models.layers import delta_rule

torch.set_num_threads(2)
spec = importlib.util.spec_from_file_location("sluice.models.layers.old_delta_rule", sys.argv[1])
old = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = old
spec.loader.exec_module(old)
T, Hv, D, SLICE = 2048, 32, 128, 256
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(T, Hv, D, generator=g).bfloat16() for _ in range(3))
gg, beta = -torch.rand(T, Hv, generator=g), torch.rand(T, Hv, generator=g)


def run(mod):
    state, outs = torch.zeros(Hv, D, D), []
    t = time.perf_counter()
    for i in range(0, T, SLICE):
        outs.append(mod.chunked(q[i:i + SLICE], k[i:i + SLICE], v[i:i + SLICE], gg[i:i + SLICE], beta[i:i + SLICE],
                                state))
    return (time.perf_counter() - t) * 1000, torch.cat(outs).float()


times = {"old": [], "new": []}
for _ in range(5):
    for name, mod in (("old", old), ("new", delta_rule)):
        ms, out = run(mod)
        times[name].append(ms)
        if name == "old":
            ref = out
        else:
            diff = (out - ref).abs().max().item() / ref.abs().max().item()
print({k: f"{statistics.median(v):.0f} ms (rounds {[round(x) for x in v]})" for k, v in times.items()},
      f"largest difference of the bf16 outputs (the model's dtype) relative to the largest: {diff:.1e}")
