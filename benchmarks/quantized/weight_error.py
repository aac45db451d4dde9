"""How far each quantized type of a GGUF file moves the weights from the bf16 source: relative L2 of the file's
dequantized tensors (the `gguf` package's dequantization) against the same tensors of the bf16 GGUF, one tensor
per type (its first 4M weights). The figure `--activations auto` rests on (sluice/plan.py _activations): a type whose
own rounding is 20-40x int8's coding error of a projection's input (0.5-0.8%, tests/quant/test_q8.py's table) gains
nothing from int16's finer coding.

    .venv/bin/python benchmarks/quantized/weight_error.py benchmarks/models/qwen3_moe-peers/model.gguf \\
        benchmarks/models/qwen3_moe-peers/model-{Q2_K,IQ4_XS,Q4_K_M}.gguf
"""

from __future__ import annotations

import argparse

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

N = 4_000_000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="the bf16 (or F32) GGUF the files were quantized from")
    ap.add_argument("files", nargs="+", help="quantized GGUF files of the same model")
    a = ap.parse_args()
    src = {t.name: t for t in GGUFReader(a.source).tensors}
    print("| file | type | tensor | weight relative L2 error |\n|---|---|---|---|")
    for f in a.files:
        seen: set[str] = set()
        for t in GGUFReader(f).tensors:
            kind = t.tensor_type.name
            if kind in seen or kind in ("F32", "F16", "BF16") or t.name not in src:
                continue
            seen.add(kind)
            q = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)[:N]
            s = src[t.name]
            w = dequantize(s.data, s.tensor_type).astype(np.float32).reshape(-1)[:N]
            print(f"| {f.rsplit('/', 1)[-1]} | {kind} | {t.name} | {np.linalg.norm(q - w) / np.linalg.norm(w):.3e} |")


if __name__ == "__main__":
    main()
