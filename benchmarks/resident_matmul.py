"""How a prompt's bf16 rows multiply bf16 weights (LoadOptions.matmul) and how its first pass attends, measured:

1. `gemm`: one projection of [T x 1024] @ [1024 x 1024]^T, 2 threads, torch's bf16 GEMM against both sides widened
   to float32 (rows_linear's "float32"), and float32 inputs alone; GFLOP/s. With bf16 dot-product instructions
   (AVX512_BF16, AMX) the bf16 GEMM wins several-fold; without them (AVX2) it loses ~6x.
2. `sdpa`: causal attention of a 2,048-token first pass (8 heads of 128, 2 kv heads, bf16): an explicit boolean mask
   against SDPA's is_causal (which skips the blocks above the diagonal); same bits checked.
3. `crossover`: a GGUF-quantized projection's float row kernel (native.linear) against dequantization straight to
   bf16 + one bf16 GEMM (NativeKernel's many-row route under --matmul bf16) by rows: where BF16_GEMM_MIN_ROWS sits.
4. `prefill`: resident prefill of a prompt (default 2,048 tokens) on a model, `--matmul bf16` against `float32`
   alternated in one process (the option is process-wide and set at each load), median ms; logits compared.

    .venv/bin/python benchmarks/resident_matmul.py [gemm sdpa crossover prefill] [--model M] [--prompt 2048]
        [--rounds 3]      # --model also takes a quantized GGUF (the peers Q4_K_M file)

Prints `host/cpus.bf16_dot()` (what `--matmul auto` picks) first.
"""

from __future__ import annotations

import sluice  # first: it sets torch's OpenMP wait policy before torch loads

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from sluice.host.cpus import bf16_dot

PEERS_BF16 = "benchmarks/models/qwen3_moe-peers/model.gguf"


def _ms(f, n: int = 15) -> float:
    f()
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return 1000 * statistics.median(ts)


def gemm() -> None:
    for T in (32, 256, 2048):
        g = torch.Generator().manual_seed(T)
        x, w = torch.randn(T, 1024, generator=g).bfloat16(), torch.randn(1024, 1024, generator=g).bfloat16()
        xf, wf = x.float(), w.float()
        gf = 2 * T * 1024 * 1024 / 1e6  # MFLOP: / ms = GFLOP/s
        a = _ms(lambda: F.linear(x, w))
        b = _ms(lambda: F.linear(x.float(), w.float()).bfloat16())
        c = _ms(lambda: F.linear(xf, wf))
        print(f"gemm T={T}: bf16 {a:.3f} ms ({gf / a:.0f} GFLOP/s), via float32 {b:.3f} ms ({gf / b:.0f}), "
              f"float32 inputs {c:.3f} ms ({gf / c:.0f})")


def sdpa() -> None:
    T = 2048
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, T, 128, generator=g).bfloat16()
    k, v = (torch.randn(1, 2, T, 128, generator=g).bfloat16() for _ in range(2))
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    a = _ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), 5)
    b = _ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), 5)
    same = torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
                       F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    print(f"sdpa {T} tokens bf16: mask {a:.1f} ms, is_causal {b:.1f} ms ({'same bits' if same else 'BITS DIFFER'})")


def crossover() -> None:
    from sluice.quant import native
    from sluice.quant.kernels import QuantSpec
    from sluice.quant.native.kernel import NativeKernel
    from sluice.quant.samples import random_stored

    native.set_threads(2)
    for name, n, k in (("Q4_K", 1024, 1024), ("Q6_K", 1024, 512)):
        spec = QuantSpec.ggml(name, n, k)
        raw, kern, scratch = random_stored(spec, seed=1), NativeKernel(spec, torch.bfloat16), torch.empty(n * k)
        for T in (4, 8, 12, 16, 24, 32, 48):
            x = torch.randn(T, k).bfloat16()
            xf = x.float()
            a = _ms(lambda: native.linear(spec, xf, raw).to(torch.bfloat16), 30)
            b = _ms(lambda: kern._bf16_gemm(x, raw, scratch), 30)
            print(f"crossover {name} [{n} x {k}] T={T}: row kernel {a:.3f} ms, dequantize to bf16 + GEMM {b:.3f} ms")


def prefill(model: str, n: int, rounds: int) -> None:
    prompt = [100 + (i * 7919) % 30000 for i in range(n)]
    res: dict[str, list[float]] = {"bf16": [], "float32": []}
    logits = {}
    for r in range(rounds):
        for arm in (list(res) if r % 2 == 0 else list(res)[::-1]):
            with sluice.load(model, memory="all", threads=2, matmul=arm) as m:
                m.replay(prompt[:64], [1])  # warm-up
                m.replay(prompt, [1])
                res[arm].append(1000 * m.step_times.prefill_s)
                logits[arm] = m.logits(prompt[:256])[-1]
            print(f"round {r} {arm}: {res[arm][-1]:.0f} ms", flush=True)
    a, b = logits["bf16"], logits["float32"]
    for arm, v in res.items():
        med = statistics.median(v)
        print(f"prefill {n} tokens --matmul {arm}: median {med:.0f} ms = {n / med * 1000:.1f} tok/s")
    print(f"last logits of a 256-token prompt, bf16 vs float32: relative L2 {((a - b).norm() / b.norm()).item():.2e},"
          f" argmax {'same' if a.argmax() == b.argmax() else 'differs'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="*", default=["gemm", "sdpa", "crossover", "prefill"])
    ap.add_argument("--model", default=PEERS_BF16)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(2)
    print(f"bf16 dot-product instructions (host/cpus.bf16_dot, what --matmul auto picks): {bf16_dot()}")
    for part in a.parts:
        if part == "prefill":
            prefill(a.model, a.prompt, a.rounds)
        else:
            {"gemm": gemm, "sdpa": sdpa, "crossover": crossover}[part]()


if __name__ == "__main__":
    main()
