"""How often a decode token's router and guess meet a tie at their top k, and an in-process A/B of resolving those
ties natively (topk.cc: torch.topk's own algorithms, the default where quant/native/decode.py ties_exact holds)
against handing them to torch.topk (the way before: routing.top_of_probs for the router, torch.topk over the
guess's probabilities). One model, one greedy stream after [5, 6] (40 tokens skipped): both ways pick the same
experts (tests/quant/test_decode.py), so the stream is the same; per round each arm switches the setting on, runs
one token untimed and 16 timed (benchmarks/common.py alternate_tokens, arm order rotated). MODE as
benchmarks/common.py decode_options (auto: streamed at --memory 640MiB, O_DIRECT, no cgroup, --prefetch auto).

    .venv/bin/python benchmarks/results/hybrid/ties_ab.py auto ROUNDS [MODEL]
"""
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

import sluice  # noqa: F401 - before torch (its OpenMP threads)
import torch
import sluice.quant.native.decode as decode
import sluice.models.layers.moe as moe
from benchmarks.common import HYBRID_Q4, alternate_tokens, decode_stream, print_paired

mode, rounds = sys.argv[1], int(sys.argv[2])
M = sys.argv[3] if len(sys.argv) > 3 else HYBRID_Q4
m, it = decode_stream(M, mode)
pre = m.model.prerouter
exact = decode.ties_exact()  # before the switches below set its answer
guesses = list(getattr(pre, "_guess", {}).values())
blocks = [layer.ffn for layer in m.model.layers if isinstance(getattr(layer, "ffn", None), moe.MoE)]


def switch(on: bool):
    def f():
        for blk in blocks:  # the true router's (MoE.ties, chosen at load)
            blk.ties = on
        for g in guesses:
            g.ties = decode._TOPK_FN if on else None
    return f


# how often: the router's and the guess's top k over 32 tokens, ties handed to torch
count = collections.Counter()
topk, guess_call = moe.topk_probs, decode.Guess.__call__


def counted_topk(probs, k, norm, dtype, ties=None):
    out = topk(probs, k, norm, dtype, ties)
    count["router", out is None] += 1
    return out


def counted_guess(self, x):
    out = guess_call(self, x)
    count["guess", isinstance(out, torch.Tensor)] += 1
    return out


switch(False)()
moe.topk_probs, decode.Guess.__call__ = counted_topk, counted_guess
for _ in range(32):
    next(it)
moe.topk_probs, decode.Guess.__call__ = topk, guess_call
for who in ("router", "guess"):
    n, tied = count[who, False] + count[who, True], count[who, True]
    print(f"{who}: {tied} of {n} top-k calls ({100 * tied / max(n, 1):.1f}%) met a tie or a NaN (torch.topk's to "
          "choose without topk.cc)")
print(f"ties_exact on this build: {exact}; guesses: {len(guesses)} layers")
res = alternate_tokens(it, {"torch": switch(False), "native": switch(True)}, rounds)
print_paired(res, "torch", "native", f"{mode} ties by {{arm}}", "natively")
it.close()
m.close()
