"""One decode token through one FP8 expert: the float row kernel on the FP8 bytes (native/fp8.h in kernels.c) against
the same kernel on Q8_0 blocks and torch's bf16 F.linear on bf16 weights, and the prompt route's dequantization to
bf16. One thread (native pool and torch), thread CPU time, arms alternated, median of rounds.

    .venv/bin/python benchmarks/fp8/kernel.py [--rounds 21] [--reps 20]

Shapes: an expert of Qwen3-30B-A3B-FP8 (gate / up [768 x 2048], down [2048 x 768]) and of DeepSeek-V3 / Kimi K2
(gate / up [2048 x 7168], down [7168 x 2048]), 128 x 128 blocks, F32 scales. Prints the CPU (model name, cores, SIMD
flags), then one JSON line per shape: ms per expert (its three projections) for each arm.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from benchmarks.common import median_ms  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (768, 2048), "deepseek-v3": (2048, 7168)}


def cpu_line() -> str:
    info = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    simd = sorted(f for f in flags if f in ("avx2", "fma", "f16c") or f.startswith(("avx512", "amx")))
    return f"{model}, {os.cpu_count()} logical CPUs, {' '.join(simd)}"


def _raw(spec, tensors):
    import torch

    raw = torch.zeros(spec.nbytes, dtype=torch.uint8)
    for part, t in zip(spec.parts, tensors):
        raw[part.offset: part.offset + part.nbytes] = t.contiguous().view(torch.uint8).flatten()
    return raw


def expert(inter: int, hidden: int) -> dict:
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants

    from sluice.quant import QuantSpec
    from sluice.quant.fp8 import quantize_fp8
    from sluice.quant.native import AVX2, PORTABLE, kernels

    g = torch.Generator().manual_seed(0)
    shapes = [(inter, hidden), (inter, hidden), (hidden, inter)]
    ws = [torch.randn(s, generator=g) * 0.02 for s in shapes]
    fp8 = [(QuantSpec.fp8(*s), _raw(QuantSpec.fp8(*s), quantize_fp8(w))) for s, w in zip(shapes, ws)]
    q8 = [(QuantSpec.ggml("Q8_0", *s), torch.from_numpy(quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0))
           .view(torch.uint8).flatten()) for s, w in zip(shapes, ws)]
    bf = [w.bfloat16() for w in ws]
    xs = {hidden: torch.randn(1, hidden, generator=g), inter: torch.randn(1, inter, generator=g)}
    outs = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]

    def rows(projs, path):
        return lambda: [kernels.linear(spec, xs[spec.in_features], raw, path=path) for spec, raw in projs]

    arms = {
        "fp8 avx2": rows(fp8, AVX2),
        "fp8 portable": rows(fp8, PORTABLE),
        "q8_0 avx2": rows(q8, AVX2),
        "bf16 F.linear": lambda: [torch.nn.functional.linear(xs[w.shape[1]].bfloat16(), w) for w in bf],
        "fp8 -> bf16 weights": lambda: [kernels.dequantize(spec, raw, o, path=AVX2)
                                        for (spec, raw), o in zip(fp8, outs)],
    }
    assert np.isfinite(rows(fp8, AVX2)()[0].numpy()).all()
    return arms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    import torch

    from sluice.quant.native import set_threads

    torch.set_num_threads(1)
    set_threads(1)
    print(cpu_line(), flush=True)
    for name, (inter, hidden) in SHAPES.items():
        ms = median_ms(expert(inter, hidden), rounds=args.rounds, reps=args.reps, clock=time.thread_time)
        print(json.dumps({"expert": name, "shape": [inter, hidden], "ms": {k: round(v, 3) for k, v in ms.items()}}),
              flush=True)


if __name__ == "__main__":
    main()
