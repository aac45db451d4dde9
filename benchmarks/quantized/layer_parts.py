"""One resident decode layer's parts, cache-hot (issue 14): each call repeated on layer 3 of the peers Q4_K_M model
after a short replay, us per call, then a whole 16-layer forward pass and the head. Cache-hot (the same weights
each time) where a real forward pass streams every layer from DRAM, so the forward pass minus the parts' sum is what
DRAM costs. torch keeps its threads here (a decode step gives them up: Transformer.forward), so the experts'
figure also varies with torch's spinning workers.

    PYTHONPATH=. .venv/bin/python benchmarks/quantized/layer_parts.py [GGUF] [--activations int16|int8]
"""

from __future__ import annotations

import argparse
import time

import torch

import sluice
from sluice.models import blocks


def per_call_us(fn, n: int = 2000) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="benchmarks/models/qwen3_moe-peers/model-Q4_K_M.gguf")
    ap.add_argument("--activations", default="int16", choices=("int16", "int8"))
    a = ap.parse_args()
    with sluice.load(a.model, memory="all", activations=a.activations) as m, torch.inference_mode():
        tr, L = m.model, 3
        lw, s = tr.w.layers[L], tr.spec
        x = torch.randn(1, s.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
        m.replay([100], [200, 201])
        q, k, v = tr._qkv(L, x)
        attend = tr._decode_attention()[L]
        o = attend(q, k, v, 10, 0)
        w, ids = blocks.top_of_probs(s, blocks.router_probs_bf16(x, lw.router), x.dtype)
        parts = {
            "rms_norm": lambda: blocks.rms_norm(x, lw.input_norm, s.rms_norm_eps),
            "q/k/v": lambda: tr._qkv(L, x),
            "attention core": lambda: attend(q, k, v, 10, 0),
            "o": lambda: blocks.linear(o, lw.o, lw.o_bias),
            "attention (all)": lambda: tr.attention(L, x, 10, None),
            "router": lambda: blocks.top_of_probs(s, blocks.router_probs_bf16(x, lw.router), x.dtype),
            "8 experts": lambda: tr._experts_one_token(L, x, ids, w, torch.zeros_like(x)),
            "moe (all)": lambda: tr.moe(L, x),
        }
        for name, fn in parts.items():
            print(f"{name}: {per_call_us(fn):.1f} us")
        forward = per_call_us(lambda: tr._forward(torch.tensor([5]), 10), 100)
        print(f"forward pass, {s.n_layers} layers: {forward:.0f} us")
        print(f"head: {per_call_us(lambda: tr.logits(x), 200):.0f} us")


if __name__ == "__main__":
    main()
