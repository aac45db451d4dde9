"""Single QuantLinear calls (quant/resident.py) against their bf16 F.linear, medians, 2 torch threads:
  projections  the peers Q4_K_M file's head and layer-0 q/k/v at T=1 (one thread, split over native.set_threads(2))
               and at T=33 (the blocked float32 path)
  split        Q4_K [N x 1024] at T=1, one thread vs split over set_threads(2): where SPLIT_MIN_WEIGHTS comes from
  overhead     a [256 x 1024] Q4_K at T=1: QuantLinear.linear, native.linear_q8, native.LinearsQ8, the C call alone
               (us)
  head         a Q6_K head of a 151,936-token vocabulary (random valid blocks) at T=1 and T=64

    PYTHONPATH=. .venv/bin/python benchmarks/quantized/resident_ops.py [projections|split|overhead|head ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from sluice.quant.tensor import read_tensor
from sluice.quant import native
from sluice.quant.spec import QuantSpec
from sluice.quant.resident import QuantLinear, Scratch, quant_spec
from tests.quant.samples import random_stored
from sluice.models.weights import _quant_linear
from sluice.plan import open_index


def median_ms(f, n: int) -> float:
    f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return 1000 * statistics.median(ts)


def split_ms(q: QuantLinear, x: torch.Tensor, n: int) -> tuple[float, float]:
    """(one thread, split over set_threads(2)) ms of q.linear(x)."""
    native.set_threads(1)
    one = median_ms(lambda: q.linear(x), n)
    native.set_threads(2)
    two = median_ms(lambda: q.linear(x), n)
    native.set_threads(1)
    return one, two


def projections(model: str) -> None:
    index = open_index(model)
    for name in ("lm_head.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.0.self_attn.v_proj.weight"):
        ref = index[name]
        wb = read_tensor(ref, torch.bfloat16)
        q = _quant_linear(ref, quant_spec(ref, torch.bfloat16), torch.bfloat16, Scratch())
        x, x33 = torch.randn(1, ref.shape[1]).bfloat16(), torch.randn(33, ref.shape[1]).bfloat16()
        one, two = split_ms(q, x, 41)
        print(f"{name} {ref.dtype} {list(ref.shape)}: T=1 bf16 {median_ms(lambda: F.linear(x, wb), 41):.3f} ms, "
              f"QuantLinear {one:.3f}, split {two:.3f} | T=33 bf16 {median_ms(lambda: F.linear(x33, wb), 11):.2f}, "
              f"blocked float32 {median_ms(lambda: q.linear(x33), 11):.2f}")


def split() -> None:
    for rows in (1024, 2048, 4096, 8192):
        spec = QuantSpec.ggml("Q4_K", rows, 1024)
        one, two = split_ms(QuantLinear(spec, random_stored(spec), torch.bfloat16), torch.randn(1, 1024).bfloat16(),
                            101)
        print(f"Q4_K [{rows} x 1024] T=1: one thread {one:.3f} ms, split {two:.3f} ms")


def overhead() -> None:
    spec = QuantSpec.ggml("Q4_K", 256, 1024)
    raw = random_stored(spec)
    q, lq = QuantLinear(spec, raw, torch.bfloat16), native.LinearsQ8([(spec, raw)])
    x = torch.randn(1, 1024).bfloat16()
    xf, out = x.float(), torch.empty(1, 256)
    desc = native._desc(spec, raw)[:5]

    def c_only():
        native._LIB.sluice_linear_q8(*desc, None, xf.data_ptr(), 1, 2, out.data_ptr(), 0, 256, 0)

    us = {"QuantLinear.linear": lambda: q.linear(x), "native.linear_q8": lambda: native.linear_q8(spec, xf, raw),
          "native.LinearsQ8": lambda: lq(xf), "the C call alone": c_only}
    print(", ".join(f"{k} {1000 * median_ms(f, 2001):.1f} us" for k, f in us.items()))


def head() -> None:
    spec = QuantSpec.ggml("Q6_K", 151936, 1024)
    q = QuantLinear(spec, random_stored(spec), torch.bfloat16)
    wb = q.dequantize().bfloat16()
    x, x64 = torch.randn(1, 1024).bfloat16(), torch.randn(64, 1024).bfloat16()
    one, two = split_ms(q, x, 21)
    print(f"Q6_K [151936 x 1024]: T=1 bf16 F.linear {median_ms(lambda: F.linear(x, wb), 21):.1f} ms, QuantLinear "
          f"{one:.1f}, split {two:.1f}; T=64 bf16 {median_ms(lambda: F.linear(x64, wb), 5):.0f}, blocked float32 "
          f"{median_ms(lambda: q.linear(x64), 5):.0f}")


PARTS = {"split": split, "overhead": overhead, "head": head}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="*", default=["projections", "split", "overhead", "head"],
                    choices=["projections", *PARTS])
    ap.add_argument("--model", default="benchmarks/models/qwen3_moe-peers/model-Q4_K_M.gguf")
    a = ap.parse_args()
    torch.set_num_threads(2)
    for part in a.parts:
        projections(a.model) if part == "projections" else PARTS[part]()


if __name__ == "__main__":
    main()
