"""A prompt's read-ahead guess alone (prerouter/predict.py RouterPrerouter.predict: the next layer's norm and router
on the rows, top-k, the experts ranked by count) on the peers Q4_K_M file, [T, 1024] bf16 rows, the router's logits
on torch's bf16 GEMM (bf16 True) or on the float32 one (False, the model's choice without bf16 dot products), T rows
given whole; 2 threads, the median of 10 after one untimed. Run capped at AVX2 to see an AVX2 CPU's figures:

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        .venv/bin/python benchmarks/quantized/prompt_guess.py

(since GUESS_ROWS a prompt's guess ranks at most 256 of its rows: the 256-row line is what a 2,048-token prompt
costs now; the 2,048-row line, with the guess's own cap lifted, what it cost before)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import sluice  # noqa: F401  (before torch: sluice/__init__.py)
import torch

MODEL = Path(__file__).resolve().parents[1] / "models/qwen3_moe-peers/model-Q4_K_M.gguf"


def main() -> None:
    from sluice.host.cpus import cpu_line, describe_cpu
    from sluice.prerouter import predict

    print("CPU", cpu_line(describe_cpu()))
    torch.set_num_threads(2)
    m = sluice.load(MODEL, memory="all", isa="avx2")
    x = torch.randn(2048, m.spec.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    predict.GUESS_ROWS = 1 << 30  # every row given, to time the row counts themselves
    for bf16 in (True, False):
        pre = predict.RouterPrerouter(m.spec, m.model.w, bf16=bf16)
        for T in (2048, 512, 256):
            xx = x[:: 2048 // T].contiguous()
            pre.predict(0, xx)
            ts = []
            for _ in range(10):
                t0 = time.perf_counter()
                pre.predict(0, xx)
                ts.append(time.perf_counter() - t0)
            print(f"bf16 GEMM {bf16} rows {T}: {1e3 * sorted(ts)[5]:.2f} ms a layer")


if __name__ == "__main__":
    sys.exit(main())
