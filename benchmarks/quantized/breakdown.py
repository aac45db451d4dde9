"""Where a resident step's time goes on the peers Q4_K_M file (wall time of the model's pieces, wrapped; 2 threads):

    .venv/bin/python benchmarks/quantized/breakdown.py prompt [--isa avx2]   # a 2,048-token prompt in one pass, 3 runs
    .venv/bin/python benchmarks/quantized/breakdown.py decode [--isa avx2]   # 33 decode steps after 36 tokens, 3 runs
    .venv/bin/python benchmarks/quantized/breakdown.py bandwidth             # a 1 GiB float32 sum, 2 threads and 1
    .venv/bin/python benchmarks/quantized/breakdown.py moe [--isa avx2]      # a decode MoE block's pieces, us a layer

Capped runs (`--isa avx2`) need torch capped too: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2 in the environment. Seconds per piece, summed over the run (prompt) or per step
(decode, ms). The wrapped pieces nest: `layer` holds `attn` and `moe`; `moe` holds `experts_run` (a prompt's expert
passes, which hold `experts_C`, their native calls) and `combine`; `attn` holds `attn.qkv`, `attn.attend` and
`attn.out`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import sluice  # before torch (sluice sets OMP_WAIT_POLICY=PASSIVE for torch's OpenMP workers, read once
#                 when torch loads libgomp, as the CLI and `sluice bench` have it; imported after torch, the workers
#                 spin after every parallel op and take the cores the native pool runs on: the AVX2 prompt took
#                 6.58-6.96 s that way against 4.70-4.74: results/quantized/breakdown/)
import torch

MODEL = Path(__file__).resolve().parents[1] / "models/qwen3_moe-peers/model-Q4_K_M.gguf"


def _timed(T: dict, owner, attr: str, key: str) -> None:
    """owner.attr (a method, a module's function, a ctypes entry point) wrapped: its wall time summed into T[key]."""
    f = getattr(owner, attr)

    def g(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        T[key] = T.get(key, 0.0) + time.perf_counter() - t
        return r

    setattr(owner, attr, g)


def _wrap(T: dict) -> None:
    from sluice.models import model as mm
    from sluice.models.layers import attention as att, moe, residual
    from sluice.quant.native import ops, prompt

    for name in ("sluice_prompt_expert_coded", "sluice_prompt_experts_coded"):  # the experts' C calls (either entry)
        if hasattr(prompt._LIB, name):
            _timed(T, prompt._LIB, name, "experts_C")
    _timed(T, ops, "combine_rows_bf16", "combine")

    _timed(T, residual.PreNorm, "__call__", "layer")
    _timed(T, moe.MoE, "__call__", "moe")
    _timed(T, moe.Experts, "_run", "experts_run")
    _timed(T, att.Attention, "__call__", "attn")
    _timed(T, att.Attention, "qkv", "attn.qkv")
    _timed(T, att.Attention, "attend", "attn.attend")
    _timed(T, att.Attention, "out", "attn.out")
    _timed(T, mm.Transformer, "logits", "logits")


def _decode_runs(m, T: dict):
    """3 runs of 33 decode steps after 36 tokens, T cleared before each run's steps: yields (the median step in ms,
    the steps + 1)."""
    ids = list(range(100, 132))
    for _ in range(3):
        m.forget_cache()
        toks = list(m.generate_tokens(ids, max_tokens=4, stop_at_eos=False))
        T.clear()
        list(m.generate_tokens(ids + toks, max_tokens=33, stop_at_eos=False))
        st = sorted(m.step_times.decode_s)
        yield 1000 * st[len(st) // 2], len(st) + 1


def _moe(T: dict, isa: str) -> None:
    """us a layer of a decode step's MoE pieces (33 steps after 36 tokens, 3 runs): `moe` the block, `router` its
    probabilities (one native call), `topk` the top-k, `native` the experts' Python and C, `C` the C call alone,
    `combine` the weighted sum; `linears` the C calls of the kept-quantized projections (ms a step: attention's and
    the LM head)."""
    from sluice.models.layers import moe
    from sluice.quant.native import ops, q8

    _timed(T, moe, "router_probs_bf16", "router")
    _timed(T, moe, "topk_probs", "topk")
    _timed(T, moe, "top_of_probs", "topk")
    _timed(T, moe.Experts, "_native", "native")
    _timed(T, moe.MoE, "__call__", "moe")
    _timed(T, ops, "combine_bf16", "combine")
    _timed(T, q8.LIB, "sluice_experts_q8", "C")
    _timed(T, q8.LIB, "sluice_linears_q8", "linears")
    m = sluice.load(MODEL, memory="all", isa=isa)
    layers = m.spec.n_layers
    for ms, n in _decode_runs(m, T):
        print(f"decode median {ms:.2f} ms/step; us a layer:",
              {k: round(1e6 * v / n / layers, 1) for k, v in T.items() if k != "linears"},
              f"linears {1000 * T.get('linears', 0) / n:.2f} ms a step")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("prompt", "decode", "bandwidth", "moe"))
    ap.add_argument("--isa", default="auto")
    a = ap.parse_args()
    from sluice.host.cpus import cpu_line, describe_cpu

    print("CPU", cpu_line(describe_cpu()), "| isa", a.isa)
    torch.set_num_threads(2)
    if a.what == "bandwidth":
        x = torch.ones(256 << 20, dtype=torch.float32)  # 1 GiB
        for threads in (2, 2, 2, 1, 1):
            torch.set_num_threads(threads)
            t = time.perf_counter()
            x.sum()
            print(f"{threads} threads: read {x.numel() * 4 / (time.perf_counter() - t) / 1e9:.1f} GB/s")
        return
    T: dict = {}
    if a.what == "moe":
        return _moe(T, a.isa)
    _wrap(T)
    if a.what == "prompt":
        m = sluice.load(MODEL, memory="all", prefill_chunk=2048, isa=a.isa)
        ids = torch.randint(0, 30000, (2048,), generator=torch.Generator().manual_seed(1)).tolist()
        for _ in range(3):
            m.forget_cache()
            T.clear()
            t = time.perf_counter()
            list(m.generate_tokens(ids, max_tokens=1, stop_at_eos=False))
            print(f"prompt + 1 token {time.perf_counter() - t:.3f} s:", {k: round(v, 3) for k, v in T.items()})
        return
    m = sluice.load(MODEL, memory="all", isa=a.isa)
    for ms, n in _decode_runs(m, T):
        print(f"decode median {ms:.2f} ms/step; ms a step:", {k: round(1000 * v / n, 2) for k, v in T.items()})


if __name__ == "__main__":
    sys.exit(main())
