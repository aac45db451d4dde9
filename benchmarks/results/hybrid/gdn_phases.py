"""A resident decode token's Gated DeltaNet layers of a model (all of them, in turn, one x), their fused native call
(DeltaNetFused) and its three phases apart: the grouped input projections (qkv, z, b, a), the step (conv, delta rule,
gated norm: the recurrent state read and written) and out_proj; ms a token for the 30 layers (best of 5 passes of
10 tokens), next to the memory bandwidth torch's sum of a 256 MiB float32 tensor reaches on 1 and 2 threads (the
bound the phases would meet with every byte from memory: the layers' weights and states do not fit in the caches).

    .venv/bin/python benchmarks/results/hybrid/gdn_phases.py benchmarks/models/qwen3_5_moe-a3b-8GiB/model-UD-IQ2_XXS.gguf
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

import sluice
import torch
import sluice.models.layers.gated_deltanet as GD
from benchmarks.common import decode_options
from sluice.models.linear import linear

big = torch.ones(64 << 20)
for th in (1, 2):
    torch.set_num_threads(th)
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        big.sum()
        ts.append(time.perf_counter() - t)
    print(f"torch sum of 256 MiB float32, {th} thread{'s' if th > 1 else ''}: {big.numel() * 4 / min(ts) / 1e9:.1f} GB/s")
del big
m = sluice.load(sys.argv[1], threads=2, max_context=600, **decode_options("resident"))
gdn = [layer.mixer for layer in m.model.layers if isinstance(getattr(layer, "mixer", None), GD.GatedDeltaNet)]
x = (torch.randn(1, gdn[0].fused.h, generator=torch.Generator().manual_seed(0)) * 0.5).bfloat16()
ys = [g.in_group.linear(x, g.in_biases) for g in gdn]
o = torch.randn(1, gdn[0].d.value_dim, generator=torch.Generator().manual_seed(1)).bfloat16()


def fused():
    for g in gdn:
        g.fused(x)


def projections():
    for g in gdn:
        g.in_group.linear(x, g.in_biases)


def step():
    for g, y in zip(gdn, ys):
        g.native(y[0].contiguous(), y[1].contiguous(), y[2].contiguous(), y[3].contiguous())


def out_proj():
    for g in gdn:
        linear(o, g.o, None, g.bf16)


print(f"{len(gdn)} Gated DeltaNet layers; state {gdn[0].cache.recurrent.numel() * 4 / 2**20:.1f} MiB a layer (float32)")
for f in (fused, projections, step, out_proj) * 2:
    f()
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(10):
            f()
        best = min(best, (time.perf_counter() - t) / 10)
    print(f"{f.__name__:12s} {best * 1e3:6.2f} ms a token ({len(gdn)} layers)")
m.close()
