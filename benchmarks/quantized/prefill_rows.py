"""Resident prefill of a quantized GGUF with the float row kernel's and the dequantization's rows split over
native.set_threads' pool (native.linear / native.dequantize, the default) against both on the calling thread (as
before: NativeKernel called them with one row range), arms alternated in one process: prefill ms of 32- and
256-token prompts, median of the rounds. The same logits either way (checked).

    PYTHONPATH=. .venv/bin/python benchmarks/quantized/prefill_rows.py [GGUF] [--rounds 4]
"""

from __future__ import annotations

import sluice  # first: it sets torch's OpenMP wait policy before torch loads

import argparse
import statistics

import torch

from sluice.quant import native
from sluice.quant.native import kernel


def one_thread_linear(spec, x, raw, out=None):
    return native.linear(spec, x, raw, out, rows=(0, spec.out_features))


def one_thread_dequantize(spec, raw, out=None):
    n, k = spec.out_features, spec.in_features
    out = torch.empty(n, k) if out is None else out
    native._LIB.sluice_dequantize(*native._desc(spec, raw), out.data_ptr(), 0, n, int(native.FORCE_SCALAR))
    return out.view(n, k)


ARMS = {"pool": (native.linear, native.dequantize), "one thread": (one_thread_linear, one_thread_dequantize)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="benchmarks/models/qwen3_moe-peers/model-Q4_K_M.gguf")
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    with sluice.load(a.model, memory="all", threads=2) as m:
        m.replay([1, 2, 3, 4, 5, 6, 7, 8], [9, 10])  # warm-up
        res: dict[tuple, list[float]] = {}
        logits: dict[tuple, torch.Tensor] = {}
        for r in range(a.rounds):
            for arm in (list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]):
                kernel.linear, kernel.dequantize = ARMS[arm]
                for n in (32, 256):
                    prompt = [100 + (i * 7) % 30000 for i in range(n)]
                    m.replay(prompt, [200, 201])
                    res.setdefault((arm, n), []).append(1000 * m.step_times.prefill_s)
                    with torch.inference_mode():
                        logits[(arm, n)] = m.model.logits(m.model.forward(torch.tensor(prompt[:40]), 0))
            print(f"round {r}: " + ", ".join(f"{arm} {n}: {v[-1]:.0f} ms" for (arm, n), v in res.items()), flush=True)
        kernel.linear, kernel.dequantize = ARMS["pool"]
        for (arm, n), v in res.items():
            same = torch.equal(logits[(arm, n)], logits[("pool", n)])
            print(f"{arm}, {n}-token prompt: median {statistics.median(v):.0f} ms ({n / statistics.median(v) * 1000:.0f}"
                  f" tok/s){'' if same else ' LOGITS DIFFER'}")


if __name__ == "__main__":
    main()
