"""How a prompt's bf16 rows multiply bf16 weights (LoadOptions.matmul) and how its first pass attends, measured:

1. `gemm`: one projection of [T x 1024] @ [1024 x 1024]^T, 2 threads, torch's bf16 GEMM against both sides widened
   to float32 (rows_linear's "float32"), and float32 inputs alone; GFLOP/s. With bf16 dot-product instructions
   (AVX512_BF16, AMX) the bf16 GEMM wins several-fold; without them (AVX2) it loses ~6x.
2. `sdpa`: causal attention of a 2,048-token first pass (8 heads of 128, 2 kv heads, bf16): an explicit boolean mask
   against SDPA's is_causal (which skips the blocks above the diagonal); same bits checked. Then matmul.sdpa (float32
   attention on bf16 dot products, the prompt path under --matmul bf16) against bf16 SDPA, both masks, with each
   one's relative error against float64.
3. `crossover`: a GGUF-quantized projection's float row kernel (native.linear) against dequantization straight to
   bf16 + one bf16 GEMM (NativeKernel's many-row route under --matmul bf16) by rows: where BF16_GEMM_MIN_ROWS sits.
4. `packed`: the demo model's expert shapes at 1 GiB, 192 experts ([7296 x 256] gate_up, [256 x 3648] down, weights
   cold in DRAM as in a prefill), F.linear on plain weights (oneDNN copies each weight into its blocked layout per
   call) against weights packed once (matmul.pack, what the resident store keeps), at 1 / 64 / 256 rows per expert;
   then the cost of a new row count (oneDNN builds kernels per shape; models/blocks.py GEMM_ROW_STEP).
5. `rows`: resident prefill of three prompts in a fresh process (the first pays for every new GEMM shape), experts'
   rows padded to a multiple of GEMM_ROW_STEP against unpadded (GEMM_ROW_STEP = 1), processes alternated; ms of
   each prompt (--model, default the demo model at 1 GiB; --prompt tokens).
6. `prefill`: resident prefill of a prompt (default 2,048 tokens) on a model, `--matmul bf16` against `float32`
   alternated in one process (the option is process-wide and set at each load), median ms; logits compared.

    .venv/bin/python benchmarks/resident_matmul.py [gemm sdpa crossover packed rows prefill] [--model M] [--prompt 2048]
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
from sluice.quant.matmul import pack, packable, packed_linear, set_matmul
from sluice.quant.matmul import sdpa as matmul_sdpa

PEERS_BF16 = "benchmarks/models/qwen3_moe-peers/model.gguf"
# made by: sluice make-model benchmarks/models/qwen3_moe-1GiB --from demo --size 1GiB
DEMO_1GIB = "benchmarks/models/qwen3_moe-1GiB"


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
    set_matmul("bf16")
    for kw in (dict(is_causal=True), dict(attn_mask=mask)):
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True, **kw)
        err = lambda y: ((y.double() - ref).norm() / ref.norm()).item()  # noqa: E731
        plain = _ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw), 5)
        ours = _ms(lambda: matmul_sdpa(q, k, v, enable_gqa=True, **kw), 5)
        e1 = err(F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw))
        e2 = err(matmul_sdpa(q, k, v, enable_gqa=True, **kw))
        print(f"sdpa {T} tokens {'is_causal' if 'is_causal' in kw else 'mask'}: bf16 SDPA {plain:.1f} ms (error "
              f"{e1:.2e}), float32 scores on bf16 dot products (matmul.sdpa) {ours:.1f} ms (error {e2:.2e})")


def packed() -> None:
    set_matmul("bf16")
    if not packable(7296, 256):
        print("packed: torch has no oneDNN bf16 GEMM on this CPU; stores keep plain weights")
        return
    E = 192
    g = torch.Generator().manual_seed(0)
    gu = [torch.randn(7296, 256, generator=g).bfloat16() for _ in range(E)]
    dn = [torch.randn(256, 3648, generator=g).bfloat16() for _ in range(E)]
    pgu, pdn = [pack(w) for w in gu], [pack(w) for w in dn]
    for M in (1, 64, 256):
        x, h = torch.randn(M, 256, generator=g).bfloat16(), torch.randn(M, 3648, generator=g).bfloat16()
        plain, ours = [], []
        for _ in range(3):  # alternated; each pass walks 1 GiB of weights, so each expert's are cold
            t = time.perf_counter()
            for e in range(E):
                F.linear(x, gu[e]), F.linear(h, dn[e])
            plain.append(time.perf_counter() - t)
            t = time.perf_counter()
            for e in range(E):
                packed_linear(x, pgu[e]), packed_linear(h, pdn[e])
            ours.append(time.perf_counter() - t)
        print(f"packed {E} experts x {M} rows: F.linear {1000 * statistics.median(plain):.0f} ms, packed "
              f"{1000 * statistics.median(ours):.0f} ms")
    first, again = [], []
    for M in range(40, 104):  # row counts this process has not seen
        x = torch.randn(M, 256, generator=g).bfloat16()
        t = time.perf_counter()
        packed_linear(x, pgu[0])
        first.append(time.perf_counter() - t)
        t = time.perf_counter()
        packed_linear(x, pgu[0])
        again.append(time.perf_counter() - t)
    print(f"packed [7296 x 256], a new row count 40-103: first call {1000 * statistics.median(first):.2f} ms, "
          f"again {1000 * statistics.median(again):.2f} ms (medians)")


def crossover() -> None:
    from sluice.quant import native
    from sluice.quant.spec import QuantSpec
    from sluice.quant.native.kernel import NativeKernel
    from tests.quant.samples import random_stored

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


ROWS_CHILD = """
import sys, torch
import sluice
from sluice.models import blocks
blocks.GEMM_ROW_STEP = int(sys.argv[3])
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 1000, (int(sys.argv[2]),), generator=g).tolist() for _ in range(3)]
with sluice.load(sys.argv[1], memory="all", threads=2) as m:
    for p in prompts:
        list(m.generate_tokens(p, max_tokens=1, stop_at_eos=False))
        print(m.stats()["prefill_ms"])
"""


def rows(model: str, n: int, rounds: int) -> None:
    import subprocess
    import sys

    from sluice.models.blocks import GEMM_ROW_STEP

    res: dict[int, list[list[float]]] = {GEMM_ROW_STEP: [], 1: []}
    for r in range(rounds):
        for step in (list(res) if r % 2 == 0 else list(res)[::-1]):
            out = subprocess.run([sys.executable, "-c", ROWS_CHILD, model, str(n), str(step)], check=True,
                                 capture_output=True, text=True).stdout.split()
            res[step].append([float(x) for x in out])
            print(f"round {r} GEMM_ROW_STEP={step}: prompts {' / '.join(f'{float(x):.0f}' for x in out)} ms",
                  flush=True)
    for step, runs in res.items():
        med = [statistics.median(run[i] for run in runs) for i in range(3)]
        print(f"rows {n} tokens, GEMM_ROW_STEP={step}: median first / second / third prompt "
              f"{' / '.join(f'{x:.0f}' for x in med)} ms")


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
    ap.add_argument("parts", nargs="*", default=["gemm", "sdpa", "crossover", "packed", "rows", "prefill"])
    ap.add_argument("--model", default=PEERS_BF16)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(2)
    print(f"bf16 dot-product instructions (host/cpus.bf16_dot, what --matmul auto picks): {bf16_dot()}")
    for part in a.parts:
        if part == "prefill":
            prefill(a.model, a.prompt, a.rounds)
        elif part == "rows":
            rows(a.model if a.model != PEERS_BF16 else DEMO_1GIB, a.prompt, a.rounds)
        else:
            {"gemm": gemm, "sdpa": sdpa, "crossover": crossover, "packed": packed}[part]()


if __name__ == "__main__":
    main()
