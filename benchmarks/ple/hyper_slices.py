"""One hyper-connection mix + inject (models/layers/hyper.py) at qwen4_exp's prompt shapes, run whole and in row
slices: ms per call (best of 5) and minor page faults per call, and whether the slices give the same bits.

    .venv/bin/python benchmarks/ple/hyper_slices.py [--tokens 2140] [--slices 32 64 256]

The ops are hyper.py's (HyperConnection._mix on stand-in weights of the real shapes, hyper.inject) with HC_SLICE
set per arm."""

from __future__ import annotations

import argparse
import resource
import time
from types import SimpleNamespace

import torch

from sluice.models.layers import hyper
from sluice.models.layers.norm import Norm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2140)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--rank", type=int, default=320)
    ap.add_argument("--slices", type=int, nargs="+", default=[32, 64, 256])
    a = ap.parse_args()
    torch.manual_seed(0)
    T, n, H, r = a.tokens, a.streams, a.hidden, a.rank
    bf = torch.bfloat16
    x, out = torch.randn(T, n * H).to(bf), torch.randn(T, H).to(bf)
    w = SimpleNamespace(down=(torch.randn(r, n * H) * 0.02).to(bf), up=(torch.randn(n * H, r) * 0.05).to(bf),
                        inject=(torch.randn(n, n * H) * 0.02).to(bf))
    hc = hyper.HyperConnection.__new__(hyper.HyperConnection)
    hc.n, hc.H, hc.w, hc.bf16 = n, H, w, True
    hc.norm = Norm(torch.randn(n * H) * 0.1, 1e-6, zero_centred=True, group=H)

    def call():
        h, weights = hc(x)
        return h, hyper.inject(x, out, weights)

    results = {}
    for size in [T, *a.slices, T]:
        hyper.HC_SLICE = size
        call()
        faults, times = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, []
        for _ in range(5):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) // 5
        res = call()
        same = size not in results and all(torch.equal(p, q) for p, q in zip(res, results.get(T, res)))
        results.setdefault(size, res)
        print(f"{'whole' if size == T else f'slices of {size}':>14}: {min(times) * 1e3:7.1f} ms, {faults} minor "
              f"faults a call" + ("" if size == T else f", same bits as whole: {same}"))


if __name__ == "__main__":
    main()
