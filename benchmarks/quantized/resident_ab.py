"""Resident projections of a GGUF as bf16 tensors (before QuantLinear) / QuantLinear / QuantLinear with
native.set_threads(2), in one process, arms alternated: decode ms/token (median per replay of 48 tokens) and the
prefill of a 256-token prompt.

    PYTHONPATH=. .venv/bin/python benchmarks/quantized/resident_ab.py [GGUF] [--rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

import sluice
from sluice.quant import native
from sluice.quant.resident import QuantLinear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="benchmarks/models/qwen3_moe-peers/model-Q4_K_M.gguf")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    prompt, tokens = [100 + i % 3000 * 7 % 30000 for i in range(256)], list(range(200, 248))
    with sluice.load(a.model, memory="all", threads=2) as m:
        w = m.model.w
        fields = [(o, f.name, getattr(o, f.name)) for o in [w, *w.layers] for f in dataclasses.fields(o)
                  if isinstance(getattr(o, f.name), QuantLinear)]
        plain = [q.dequantize().to(torch.bfloat16) for _, _, q in fields]
        print(f"{len(fields)} QuantLinear weights")

        def use(arm: str) -> None:
            for (o, name, q), p in zip(fields, plain):
                setattr(o, name, p if arm == "bf16" else q)
            native.set_threads(2 if arm == "QuantLinear + threads" else 1)

        arms = ("bf16", "QuantLinear", "QuantLinear + threads")
        decode: dict[str, list[float]] = {arm: [] for arm in arms}
        prefill: dict[str, list[float]] = {arm: [] for arm in arms}
        for arm in arms:
            use(arm)
            m.replay(prompt, tokens[:4])  # warm-up
        for r in range(a.rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                use(arm)
                m.replay(prompt, tokens)
                decode[arm].append(1000 * statistics.median(m.step_times.decode_s))
                prefill[arm].append(1000 * m.step_times.prefill_s)
        use("QuantLinear + threads")
        for arm in arms:
            print(f"{arm:22s} decode {statistics.median(decode[arm]):6.1f} ms/token, prefill of {len(prompt)} tokens "
                  f"{statistics.median(prefill[arm]):6.0f} ms (medians of {a.rounds})")


if __name__ == "__main__":
    main()
