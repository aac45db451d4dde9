"""The resident decode kernels of the issue-30 model (benchmarks/hybrid/run.sh makes it), a layer at a time over all 30
Gated DeltaNet layers (their weights come from DRAM, as in a decode token): the grouped input projections (q | k | v
Q6_K, z Q4_K, b, a) and out_proj (Q4_K) on 1 vs 2 pool threads, then the grouped projections with 1 vs 2 planes of
activation codes (--activations int8 / int16), alternated, 12 rounds of 10 passes, medians per layer.

    .venv/bin/python benchmarks/results/hybrid/resident_kernels.py
"""
import time, torch, sluice, gc, statistics
from sluice.quant.native import pool
Q = "benchmarks/models/qwen3_5_moe-a3b-8GiB/model-Q4_K_M.gguf"
m = sluice.load(Q, memory="all", threads=2, max_context=200)
from sluice.models.layers.gated_deltanet import GatedDeltaNet
from sluice.models.linear import linear
gs = [o for o in gc.get_objects() if isinstance(o, GatedDeltaNet)]
x = torch.randn(1, 512, dtype=torch.bfloat16); o = torch.randn(1, 4096, dtype=torch.bfloat16)
def layer_pass():  # all 30 layers' in_group + out_proj: DRAM-resident like a decode token
    for g in gs:
        g.in_group.linear(x, g.in_biases); linear(o, g.o, None, g.bf16)
res = {1: [], 2: []}
for rep in range(12):
    for th in ((1, 2) if rep % 2 else (2, 1)):
        pool.set_threads(th)
        for _ in range(3): layer_pass()
        t = time.perf_counter()
        for _ in range(10): layer_pass()
        res[th].append((time.perf_counter() - t) / 10 / 30 * 1e6)
for th, v in res.items():
    print(th, "threads: per layer (in_group + out_proj) median %.0f us, min %.0f" % (statistics.median(v), min(v)))
xf = x.float()
Ls = [g.in_group._q8 for g in gs]
pool.set_threads(2)
res = {1: [], 2: []}
for rep in range(12):
    for P in ((1, 2) if rep % 2 else (2, 1)):
        for _ in range(3):
            for L in Ls: L(xf, P, out_dtype=torch.bfloat16)
        t = time.perf_counter()
        for _ in range(10):
            for L in Ls: L(xf, P, out_dtype=torch.bfloat16)
        res[P].append((time.perf_counter() - t) / 10 / 30 * 1e6)
for P, v in res.items():
    print("planes", P, ": in_group (qkv Q6_K + z Q4_K + b, a) per layer median %.0f us" % statistics.median(v))
