"""The cost of one tie, alone: a decode token's top k of probabilities that tie (bf16 logits of 256 experts,
softmaxed; k = 8, norm_topk_prob, bf16 weights: the issue-30 models' router) natively (topk_probs with ties, topk.cc)
against the way before (topk_probs returns None, routing.top_of_probs runs torch.topk, the sum, the division, the
cast), and the guess's (Guess with ties against the probabilities handed to torch.topk and .tolist()). us a call,
the median of 15 rounds of 2,000 calls (benchmarks/common.py median_ms, rounds alternated).

    .venv/bin/python benchmarks/results/hybrid/ties_calls.py
"""
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

import sluice  # noqa: F401 - before torch (its OpenMP threads)
import torch
from benchmarks.common import median_ms
from sluice.models.routing import top_of_probs
from sluice.quant.native.decode import Guess, ties_exact, topk_probs

torch.set_num_threads(1)
E, H, k = 256, 512, 8
g = torch.Generator().manual_seed(0)
probs = torch.softmax(torch.randn(1, E, generator=g).bfloat16().float() * 2, dim=-1)
order = torch.argsort(probs[0], descending=True)
probs[0, order[k]] = probs[0, order[k - 1]].item()  # a tie at the k-th
spec = SimpleNamespace(top_k=k, norm_topk_prob=True, router_weights_fp32=False)
assert topk_probs(probs, k, True, torch.bfloat16, ties=False) is None
got, want = topk_probs(probs, k, True, torch.bfloat16, ties=True), top_of_probs(spec, probs, torch.bfloat16)
assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def before():
    if topk_probs(probs, k, True, torch.bfloat16, ties=False) is None:
        top_of_probs(spec, probs, torch.bfloat16)


w = (torch.randn(E, H, generator=g) * 0.1).bfloat16()
scale = 1.0 + 0.1 * torch.randn(H, generator=g)
slow, fast = Guess(scale, 1e-6, w, k, ties=False), Guess(scale, 1e-6, w, k, ties=True)
x = None
for i in range(1000):  # an x whose guess ties
    x = (torch.randn(1, H, generator=g) * (1 + i % 7)).bfloat16()
    if isinstance(slow(x), torch.Tensor):
        break
assert isinstance(slow(x), torch.Tensor) and isinstance(fast(x), list)


def guess_before():
    out = slow(x)
    if isinstance(out, torch.Tensor):
        sorted(torch.topk(out, k, dim=-1).indices[0].tolist())


def guess_now():
    sorted(fast(x))


N = 2000
t = median_ms({"router torch": lambda: [before() for _ in range(N)],
               "router native": lambda: [topk_probs(probs, k, True, torch.bfloat16, ties=True) for _ in range(N)],
               "guess torch": lambda: [guess_before() for _ in range(N)],
               "guess native": lambda: [guess_now() for _ in range(N)]}, rounds=15)
print(f"ties_exact: {ties_exact()}")
for name, ms in t.items():
    print(f"{name:14s} {ms / N * 1e3:7.2f} us a call")
print(f"a tie costs torch {t['router torch'] / N * 1e3 - t['router native'] / N * 1e3:.2f} us more at the router, "
      f"{t['guess torch'] / N * 1e3 - t['guess native'] / N * 1e3:.2f} us more at the guess")
