"""The prompt path's settings, each measured against its alternatives (one model, quiet; decode's: benchmarks/knobs.py).

    .venv/bin/python benchmarks/prefill/knobs.py blocks  [--model FOLDER] [--rounds 6] [--prompts 512 2048]
    .venv/bin/python benchmarks/prefill/knobs.py dequant [--rounds 15]
    .venv/bin/python benchmarks/prefill/knobs.py profile [--model GGUF] [--prompts 2048]
    .venv/bin/python benchmarks/prefill/knobs.py int8    [--rounds 15]
    .venv/bin/python benchmarks/prefill/knobs.py gemm    [--rounds 15]
    .venv/bin/python benchmarks/prefill/knobs.py tiles   [--rounds 15]   (AVX2: the env below)
    .venv/bin/python benchmarks/prefill/knobs.py attend  [--rounds 15] [--prompts 2048]
    .venv/bin/python benchmarks/prefill/knobs.py code    [--model GGUF] [--rounds 6] [--prompts 2048]
    .venv/bin/python benchmarks/prefill/knobs.py reads   [--model GGUF] [--rounds 6] [--prompts 2048]
    .venv/bin/python benchmarks/prefill/knobs.py matmul | sdpa | crossover | packed        (2 threads)
    .venv/bin/python benchmarks/prefill/knobs.py rows    [--model FOLDER] [--rounds 3] [--prompts 2048]
    .venv/bin/python benchmarks/prefill/knobs.py matmul-prefill [--model GGUF] [--rounds 3] [--prompts 2048]
    .venv/bin/python benchmarks/prefill/knobs.py activation [--model GGUF] --prompts 512   (then --prompts 2048)

Models: GGUF default the peers model's Q4_K_M file, FOLDER the demo model at 1 GiB, matmul-prefill's the peers bf16
GGUF (benchmarks/common.py). In-process arms alternate in rotated order per round (common.alternate; median ms),
and the settings they flip go through common.with_kernels.

blocks: an expert's prompt rows in row blocks (matmul.row_blocks) against one GEMM for all its rows, the first and
the next two prompts of a fresh process per arm and round (oneDNN builds kernels per new row count in each
process), arms alternated; medians of prefill ms.
dequant: ms to dequantize a [1024 x 1024] Q4_K and a [1024 x 512] Q6_K projection (one peers-model expert) to bf16
and to float32, one thread, median of rounds of 50.
profile: where a warm resident prompt's time goes (cProfile of the second prompt; seconds in the heaviest calls).
int8: torch's int8 GEMM (torch._int_mm, s8 x s8 -> s32) against its bf16 GEMM on a [256 x 1024] @ [1024 x 1024]
expert projection, median ms of rounds of 30.
gemm: one prompt expert's Q4_K projections (256 rows; the peers model's shapes) on 8-bit activations
(native/prompt.c, what --activations int8 runs) against dequantizing to bf16 + torch's bf16 GEMM (the default) and
that GEMM alone, 2 native / torch threads, alternated, median ms of rounds of 30.
tiles: what a prompt's Q4_K / Q6_K rows cost where its GEMMs are float32 (an AVX2 CPU; on an AVX-512 one run it as
`MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python ...`: MKL's float32
GEMM ignores torch's cap), 256 rows, the peers model's shapes, 2 native / torch threads, alternated, median ms of
rounds of 10: each projection on the AVX2 integer tiles (native/prompt_avx2.c, prompt_q6k.c) at activations int16
and int8 against StoredLinear's float32 route (dequantize to float32 + torch's float32 GEMM: what the model ran
before the tiles); then a whole expert (Q4_K gate / up, a Q4_K or Q6_K down) as one prompt.expert call against the
three projections in turn with silu(g) * u in torch between (GluMath before the tiles).
attend: a prompt's causal attention (8 query / 2 kv heads of 128) in native/attend.c against matmul.sdpa (bf16 dot
products where `--matmul auto` picks bf16 GEMMs), alternated, median ms of rounds of 10; and the relative error of
each against float64.
code: at --activations int8, a layer's rows coded once for all its experts (code_rows_once) against each expert coding
its own, resident, alternated in one process (a new seeded prompt each run), medians of prefill ms.
reads: a prompt's read-ahead in batches of 4 experts (streaming.PROMPT_READ_GROUP) against one expert a batch,
streamed (--io direct --odirect --memory 512MiB, int8), alternated in one process: medians of prefill ms and of the
reader's reads per prompt.
How a prompt's bf16 rows multiply bf16 weights (LoadOptions.matmul) and how its first pass attends (these were
benchmarks/resident_matmul.py's parts gemm, sdpa, crossover, packed, rows, prefill; it printed host/cpus.bf16_dot(),
what `--matmul auto` picks, first, as these do):
matmul: one projection of [T x 1024] @ [1024 x 1024]^T, torch's bf16 GEMM against both sides widened to float32
(rows_linear's "float32") and float32 inputs alone; GFLOP/s. With bf16 dot-product instructions (AVX512_BF16, AMX)
the bf16 GEMM wins several-fold; without them (AVX2) it loses ~6x.
sdpa: causal attention of a 2,048-token first pass (8 heads of 128, 2 kv heads, bf16): an explicit boolean mask
against SDPA's is_causal (which skips the blocks above the diagonal); same bits checked. Then matmul.sdpa (float32
attention on bf16 dot products, the prompt path under --matmul bf16) against bf16 SDPA, both masks, with each one's
relative error against float64.
crossover: a GGUF-quantized projection's float row kernel (native.linear) against dequantization straight to bf16 +
one bf16 GEMM (quant/linear.py's many-row route under --matmul bf16) by rows: where BF16_GEMM_MIN_ROWS sits.
packed: the demo model's expert shapes at 1 GiB, 192 experts ([7296 x 256] gate_up, [256 x 3648] down, weights cold
in DRAM as in a prefill), F.linear on plain weights (oneDNN copies each weight into its blocked layout per call)
against weights packed once (matmul.pack, what the resident store keeps), at 1 / 64 / 256 rows per expert; then the
cost of a new row count (oneDNN builds kernels per shape; models/layers/experts.py GEMM_ROW_STEP).
rows: resident prefill of three prompts in a fresh process (the first pays for every new GEMM shape), experts' rows
padded to a multiple of GEMM_ROW_STEP against unpadded (a step of 1), processes alternated; ms of each prompt.
matmul-prefill: resident prefill of a prompt, `--matmul bf16` against `float32` alternated in one process (a model
loaded per run with its own option), median ms; logits compared. --model also takes a quantized GGUF.
activation: peak RSS growth per prefill token (the per-token activation figure of store/budget.py): one forward pass
of --prompts tokens in one chunk, resident, after a warm-up pass; the growth is the peak resident set (VmHWM, reset
with /proc/self/clear_refs after the warm-up) minus the resident set before the pass. One process per length (freed
activations stay in the allocator's heap, so a second pass in the same process would grow less); the slope between
two lengths is the figure. (Was benchmarks/prefill/activation.py.)
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
import sluice  # noqa: E402  before torch: sluice sets torch's OpenMP wait policy
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from benchmarks.common import (DEMO_1G, PEERS_BF16, PEERS_Q4, alternate, child_json, median_ms,  # noqa: E402
                               medians, prompt, with_kernels)

SEEDS = itertools.count(7)  # a new seeded prompt per run: no arm reuses another's cache


def prefill_ms(m, n: int) -> float:
    """Prefill ms of a new seeded n-token prompt (one token generated after it)."""
    list(m.generate_tokens(prompt(n, next(SEEDS)), max_tokens=1, stop_at_eos=False))
    return m.stats()["prefill_ms"]


def blocks_child(model: str, n: int, split: bool) -> list[float]:
    out = []
    with with_kernels(gemm_blocks=split), sluice.load(model) as m:
        for i in range(3):
            list(m.generate_tokens(prompt(n, 100 + i), max_tokens=1, stop_at_eos=False))
            out.append(m.stats()["prefill_ms"])
    return out


def child(*args: str) -> list:
    """The last line of this script's output run as a fresh process with `args`, as JSON."""
    return child_json([sys.executable, __file__, *args])


def blocks(a) -> None:
    for n in a.prompts:
        def arm(split: bool):
            return lambda: child("blocks-child", "--model", str(a.model), "--prompts", str(n),
                                 *(["--split"] if split else []))

        res = alternate({"one GEMM": arm(False), "row blocks": arm(True)}, a.rounds)
        print(f"{n} tokens, prefill ms of a fresh process's 1st / 2nd / 3rd prompt (medians of {a.rounds}): "
              + "; ".join(f"{k} " + " / ".join(f"{statistics.median(x[i] for x in v):.0f}" for i in range(3))
                          for k, v in res.items()))


def dequant(a) -> None:
    from sluice.quant import native
    from sluice.quant.linear import bf16_view
    from sluice.quant.spec import QuantSpec

    g = torch.Generator().manual_seed(0)
    specs = [QuantSpec.ggml("Q4_K", 1024, 1024), QuantSpec.ggml("Q6_K", 1024, 512)]
    raws = [torch.randint(0, 255, (s.nbytes,), dtype=torch.uint8, generator=g) for s in specs]
    scratch = torch.empty(1024 * 1024)
    outs = {"bf16": lambda s: bf16_view(scratch, s.out_features * s.in_features),
            "float32": lambda s: scratch[: s.out_features * s.in_features]}

    def one(out):
        for s, raw in zip(specs, raws):
            native.dequantize(s, raw, out(s))

    with with_kernels(threads=1):
        ms = median_ms({name: functools.partial(one, out) for name, out in outs.items()}, a.rounds, 50, warmup=20)
    for name, v in ms.items():
        print(f"dequantize one expert to {name}: {v:.3f} ms (one thread)")


def profile(a) -> None:
    import cProfile
    import pstats

    with sluice.load(a.model, memory="all") as m:
        n = a.prompts[0]
        list(m.generate_tokens(prompt(n, 1), max_tokens=1, stop_at_eos=False))
        pr = cProfile.Profile()
        pr.enable()
        list(m.generate_tokens(prompt(n, 2), max_tokens=1, stop_at_eos=False))
        pr.disable()
        print(f"{n}-token prompt, prefill {m.stats()['prefill_ms']:.0f} ms under cProfile; seconds by function:")
        stats = pstats.Stats(pr).stats
        top = sorted(((v[2], k[2]) for k, v in stats.items()), reverse=True)[:10]
        for sec, name in top:
            print(f"  {sec:.3f}  {name}")


def int8(a) -> None:
    g = torch.Generator().manual_seed(0)
    a8 = torch.randint(-100, 100, (256, 1024), dtype=torch.int8, generator=g)
    b8 = torch.randint(-100, 100, (1024, 1024), dtype=torch.int8, generator=g)
    x, w = torch.randn(256, 1024, generator=g).bfloat16(), torch.randn(1024, 1024, generator=g).bfloat16()
    fns = {"bf16 F.linear": lambda: F.linear(x, w), "int8 torch._int_mm": lambda: torch._int_mm(a8, b8)}
    for name, ms in median_ms(fns, a.rounds, 30, warmup=5).items():
        print(f"{name}: {ms:.3f} ms ({2 * 256 * 1024 * 1024 / ms / 1e6:.0f} GOP/s)")


def gemm(a) -> None:
    from sluice.quant import native
    from sluice.quant.native import prompt as prompt_kernels
    from sluice.quant.spec import QuantSpec
    from tests.quant.samples import random_stored

    for fmt, n, k in (("Q4_K", 1024, 1024), ("Q4_K", 1024, 512)):
        spec = QuantSpec.ggml(fmt, n, k)
        raw = random_stored(spec, seed=1)
        x = torch.randn(256, k, generator=torch.Generator().manual_seed(2)).bfloat16()
        y, w = torch.empty(256, n), torch.empty(n, k, dtype=torch.bfloat16)
        with with_kernels(threads=2):
            ms = median_ms({"int8 (prompt.c)": lambda: prompt_kernels.linears([(spec, raw, y)], x),
                            "dequantize + bf16 GEMM": lambda: F.linear(x, native.dequantize(spec, raw, w)),
                            "bf16 GEMM alone": lambda: F.linear(x, w)}, a.rounds, 30, warmup=3)
        print(f"{fmt} [256 x {k}] @ [{k} x {n}]: " + ", ".join(f"{name} {v:.3f} ms" for name, v in ms.items()))


def tiles(a) -> None:
    import os
    import platform

    from sluice.quant.compute import Compute
    from sluice.quant.linear import Scratch, StoredLinear
    from sluice.quant.native import AVX2
    from sluice.quant.native import prompt as prompt_kernels
    from sluice.quant.spec import QuantSpec
    from tests.quant.samples import random_stored

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    print(f"{cpu}; MKL_ENABLE_INSTRUCTIONS={os.environ.get('MKL_ENABLE_INSTRUCTIONS', '(unset)')} "
          f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '(unset)')}")
    c, scratch, t = Compute(bf16_gemm=False, path=AVX2), Scratch(), 256
    x = {k: torch.randn(t, k, generator=torch.Generator().manual_seed(k)).bfloat16() for k in (512, 1024)}
    for fmt, n, k in (("Q4_K", 512, 1024), ("Q4_K", 1024, 512), ("Q5_K", 1024, 512), ("Q6_K", 1024, 512)):
        spec = QuantSpec.ggml(fmt, n, k)
        raw, y, before = random_stored(spec, seed=1), torch.empty(t, n), StoredLinear(spec, c)
        with with_kernels(threads=2):
            ms = median_ms({"tiles int16": lambda: prompt_kernels.linears([(spec, raw, y)], x[k], planes=2, path=AVX2),
                            "tiles int8": lambda: prompt_kernels.linears([(spec, raw, y)], x[k], planes=1, path=AVX2),
                            "dequantize + float32 GEMM": lambda: before(x[k], raw, scratch)}, a.rounds, 10, warmup=2)
        print(f"{fmt} [{t} x {k}] @ [{k} x {n}]: " + ", ".join(f"{name} {v:.3f} ms" for name, v in ms.items()))
    h, i = 1024, 512
    for dfmt in ("Q4_K", "Q6_K"):
        specs = (QuantSpec.ggml("Q4_K", i, h), QuantSpec.ggml("Q4_K", i, h), QuantSpec.ggml(dfmt, h, i))
        raws = [random_stored(s, seed=n) for n, s in enumerate(specs)]
        lins, out = [StoredLinear(s, c) for s in specs], torch.empty(t, h, dtype=torch.bfloat16)

        def three() -> torch.Tensor:
            g, u = (lin(x[h], r, scratch) for lin, r in zip(lins[:2], raws[:2]))
            return lins[2](F.silu(g) * u, raws[2], scratch)

        def one(planes: int):
            return lambda: prompt_kernels.expert(*zip(specs, raws), x[h], out, planes=planes, path=AVX2)

        with with_kernels(threads=2):
            ms = median_ms({"prompt.expert int16": one(2), "prompt.expert int8": one(1),
                            "three projections, float32 GEMMs": three}, a.rounds, 10, warmup=2)
        print(f"expert [{t} x {h}], I {i}, Q4_K gate / up, {dfmt} down: "
              + ", ".join(f"{name} {v:.3f} ms" for name, v in ms.items()))


def attend(a) -> None:
    from sluice.quant.matmul import resolve_matmul, sdpa
    from sluice.quant.native import attend as native_attend

    if not native_attend.available():
        sys.exit("knobs.py attend: needs the native extension and a CPU with AVX512_BF16")
    n = a.prompts[0]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(h, n, 128, generator=g).bfloat16() for h in (8, 2, 2))
    bf16 = resolve_matmul("auto")  # a default load's Compute.bf16_gemm: the model's prompt attention without attend.c
    outs = {"attend.c": lambda: native_attend.causal(q, k, v, 0),
            "matmul.sdpa": lambda: sdpa(q[None], k[None], v[None], bf16, is_causal=True, enable_gqa=True)[0]
            .transpose(0, 1).reshape(n, -1)}
    ref = F.scaled_dot_product_attention(q[None].double(), k[None].double(), v[None].double(), is_causal=True,
                                         enable_gqa=True)[0].transpose(0, 1).reshape(n, -1)
    with with_kernels(threads=2):
        ms = median_ms(outs, a.rounds, 10, warmup=3)
    for name, f in outs.items():
        err = float((f().double() - ref).norm() / ref.norm())
        print(f"{n} tokens, 8 / 2 heads of 128, causal: {name} {ms[name]:.1f} ms, relative error {err:.2e}")


def code(a) -> None:
    with sluice.load(a.model, memory="all", activations="int8") as m:
        list(m.generate_tokens(prompt(64, 1), max_tokens=1, stop_at_eos=False))

        def arm(once: bool):
            def one() -> float:
                with with_kernels(m, code_rows_once=once):
                    return prefill_ms(m, a.prompts[0])
            return one

        res = alternate({"coded once a layer": arm(True), "coded per expert": arm(False)}, a.rounds)
        print(f"{a.prompts[0]} tokens, prefill ms (median of {a.rounds}): "
              + ", ".join(f"{k} {v:.0f}" for k, v in medians(res).items()))


def reads(a) -> None:
    with sluice.load(a.model, memory="512MiB", io="direct", odirect=True, activations="int8") as m:
        list(m.generate_tokens(prompt(64, 1), max_tokens=1, stop_at_eos=False))

        def arm(group: int):
            def one() -> tuple[float, int]:
                before = m.reader.stats()["reads"]
                with with_kernels(read_group=group):
                    ms = prefill_ms(m, a.prompts[0])
                return ms, m.reader.stats()["reads"] - before
            return one

        res = alternate({"4 experts a batch": arm(4), "1 expert a batch": arm(1)}, a.rounds)
        print(f"{a.prompts[0]} tokens, streamed (median of {a.rounds}): "
              + ", ".join(f"{k} {statistics.median(r[0] for r in v):.0f} ms, "
                          f"{statistics.median(r[1] for r in v):.0f} reads" for k, v in res.items()))


# -- how bf16 rows multiply (LoadOptions.matmul) and how a first pass attends ------------------------------------------
def matmul(a) -> None:
    for T in (32, 256, 2048):
        g = torch.Generator().manual_seed(T)
        x, w = torch.randn(T, 1024, generator=g).bfloat16(), torch.randn(1024, 1024, generator=g).bfloat16()
        xf, wf = x.float(), w.float()
        gf = 2 * T * 1024 * 1024 / 1e6  # MFLOP: / ms = GFLOP/s
        ms = median_ms({"bf16": lambda: F.linear(x, w),
                        "via float32": lambda: F.linear(x.float(), w.float()).bfloat16(),
                        "float32 inputs": lambda: F.linear(xf, wf)}, rounds=15, warmup=2)
        print(f"gemm T={T}: " + ", ".join(f"{k} {v:.3f} ms ({gf / v:.0f} GFLOP/s)" for k, v in ms.items()))


def sdpa(a) -> None:
    from sluice.quant.matmul import sdpa as matmul_sdpa

    T = 2048
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, T, 128, generator=g).bfloat16()
    k, v = (torch.randn(1, 2, T, 128, generator=g).bfloat16() for _ in range(2))
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    ms = median_ms({"mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
                    "is_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)},
                   rounds=5, warmup=2)
    same = torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
                       F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    print(f"sdpa {T} tokens bf16: mask {ms['mask']:.1f} ms, is_causal {ms['is_causal']:.1f} ms "
          f"({'same bits' if same else 'BITS DIFFER'})")
    for kw in (dict(is_causal=True), dict(attn_mask=mask)):  # matmul.sdpa as a model on bf16 GEMMs runs it
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True, **kw)
        err = lambda y: ((y.double() - ref).norm() / ref.norm()).item()  # noqa: E731
        ms = median_ms({"plain": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw),
                        "ours": lambda: matmul_sdpa(q, k, v, True, enable_gqa=True, **kw)}, rounds=5, warmup=2)
        e1 = err(F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw))
        e2 = err(matmul_sdpa(q, k, v, True, enable_gqa=True, **kw))
        print(f"sdpa {T} tokens {'is_causal' if 'is_causal' in kw else 'mask'}: bf16 SDPA {ms['plain']:.1f} ms "
              f"(error {e1:.2e}), float32 scores on bf16 dot products (matmul.sdpa) {ms['ours']:.1f} ms (error "
              f"{e2:.2e})")


def packed(a) -> None:
    from sluice.quant.matmul import pack, packable, packed_linear

    # what a model on bf16 GEMMs (--matmul bf16) keeps for its resident bf16 experts
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
        plain = lambda: [(F.linear(x, gu[e]), F.linear(h, dn[e])) for e in range(E)]  # noqa: E731
        ours = lambda: [(packed_linear(x, pgu[e]), packed_linear(h, pdn[e])) for e in range(E)]  # noqa: E731
        # alternated; each pass walks 1 GiB of weights, so each expert's are cold
        ms = median_ms({"F.linear": plain, "packed": ours}, rounds=3, warmup=0)
        print(f"packed {E} experts x {M} rows: F.linear {ms['F.linear']:.0f} ms, packed {ms['packed']:.0f} ms")
    first, again = [], []
    for M in range(40, 104):  # row counts this process has not seen: the first call builds oneDNN's kernels
        x = torch.randn(M, 256, generator=g).bfloat16()
        t = time.perf_counter()
        packed_linear(x, pgu[0])
        first.append(time.perf_counter() - t)
        t = time.perf_counter()
        packed_linear(x, pgu[0])
        again.append(time.perf_counter() - t)
    print(f"packed [7296 x 256], a new row count 40-103: first call {1000 * statistics.median(first):.2f} ms, "
          f"again {1000 * statistics.median(again):.2f} ms (medians)")


def crossover(a) -> None:
    from sluice.quant import native
    from sluice.quant.linear import bf16_view
    from sluice.quant.spec import QuantSpec
    from tests.quant.samples import random_stored

    for name, n, k in (("Q4_K", 1024, 1024), ("Q6_K", 1024, 512)):
        spec = QuantSpec.ggml(name, n, k)
        raw, scratch = random_stored(spec, seed=1), torch.empty(n * k)
        w = bf16_view(scratch, n * k)  # the bf16 GEMM route: dequantized to bf16 in the scratch, one GEMM
        for T in (4, 8, 12, 16, 24, 32, 48):
            x = torch.randn(T, k).bfloat16()
            xf = x.float()
            with with_kernels(threads=2):
                ms = median_ms({"row": lambda: native.linear(spec, xf, raw).to(torch.bfloat16),
                                "gemm": lambda: F.linear(x, native.dequantize(spec, raw, w))}, rounds=30, warmup=2)
            print(f"crossover {name} [{n} x {k}] T={T}: row kernel {ms['row']:.3f} ms, dequantize to bf16 + GEMM "
                  f"{ms['gemm']:.3f} ms")


def rows_child(model: str, n: int, unpadded: bool) -> list[float]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for _ in range(3)]
    out = []
    with with_kernels(**({"gemm_row_step": 1} if unpadded else {})), sluice.load(model, memory="all", threads=2) as m:
        for p in prompts:
            list(m.generate_tokens(p, max_tokens=1, stop_at_eos=False))
            out.append(m.stats()["prefill_ms"])
    return out


def rows(a) -> None:
    n = a.prompts[0]

    def arm(unpadded: bool):
        return lambda: child("rows-child", "--model", str(a.model), "--prompts", str(n),
                             *(["--split"] if unpadded else []))

    res = alternate({"padded (GEMM_ROW_STEP)": arm(False), "unpadded": arm(True)}, a.rounds,
                    lambda r, k, v: print(f"round {r} {k}: prompts {' / '.join(f'{x:.0f}' for x in v)} ms", flush=True))
    for k, runs in res.items():
        med = [statistics.median(run[i] for run in runs) for i in range(3)]
        print(f"rows {n} tokens, {k}: median first / second / third prompt {' / '.join(f'{x:.0f}' for x in med)} ms")


def matmul_prefill(a) -> None:
    n = a.prompts[0]
    ids = [100 + (i * 7919) % 30000 for i in range(n)]
    logits = {}

    def arm(mode: str):
        def one() -> float:
            with sluice.load(a.model, memory="all", threads=2, matmul=mode) as m:
                m.replay(ids[:64], [1])  # warm-up
                m.replay(ids, [1])
                logits[mode] = m.logits(ids[:256])[-1]
                return 1000 * m.step_times.prefill_s
        return one

    res = alternate({"bf16": arm("bf16"), "float32": arm("float32")}, a.rounds,
                    lambda r, mode, ms: print(f"round {r} {mode}: {ms:.0f} ms", flush=True))
    for mode, med in medians(res).items():
        print(f"prefill {n} tokens --matmul {mode}: median {med:.0f} ms = {n / med * 1000:.1f} tok/s")
    x, y = logits["bf16"], logits["float32"]
    print(f"last logits of a 256-token prompt, bf16 vs float32: relative L2 {((x - y).norm() / y.norm()).item():.2e},"
          f" argmax {'same' if x.argmax() == y.argmax() else 'differs'}")


def activation(a) -> None:
    def status(key: str) -> int:
        """A VmRSS / VmHWM line of /proc/self/status, in bytes."""
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    n = a.prompts[0]
    ids = torch.randint(0, 30000, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    with sluice.load(a.model, memory="all", prefill_chunk=n, max_context=n + 16) as m:
        m.replay(ids[:64], [])  # warm-up: kernels, scratch buffers, thread pools
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = status("VmRSS")
        m.replay(ids, [])
        grown = status("VmHWM") - before
    print(f"{n} tokens in one chunk: peak RSS +{grown / 2**20:.1f} MiB = {grown / n / 1024:.1f} KiB a token")


PARTS = {"blocks": blocks, "dequant": dequant, "profile": profile, "int8": int8, "gemm": gemm, "tiles": tiles,
         "attend": attend, "code": code, "reads": reads, "matmul": matmul, "sdpa": sdpa, "crossover": crossover,
         "packed": packed, "rows": rows, "matmul-prefill": matmul_prefill, "activation": activation}
MATMUL = ("matmul", "sdpa", "crossover", "packed", "rows", "matmul-prefill")  # resident_matmul.py's: 2 torch threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=[*PARTS, "blocks-child", "rows-child"])
    ap.add_argument("--model")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--prompts", type=int, nargs="+")
    ap.add_argument("--split", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.what in ("blocks-child", "rows-child"):
        fn = blocks_child if a.what == "blocks-child" else rows_child
        print(json.dumps(fn(a.model, a.prompts[0], a.split)))
        return
    a.model = a.model or str({"blocks": DEMO_1G, "rows": DEMO_1G, "matmul-prefill": PEERS_BF16}.get(a.what, PEERS_Q4))
    a.rounds = a.rounds or (6 if a.what in ("blocks", "code", "reads") else
                            3 if a.what in ("rows", "matmul-prefill") else 15)
    a.prompts = a.prompts or {"blocks": [512, 2048]}.get(a.what, [2048])
    if a.what in MATMUL:
        from sluice.host.cpus import bf16_dot

        torch.set_num_threads(2)
        print(f"bf16 dot-product instructions (host/cpus.bf16_dot, what --matmul auto picks): {bf16_dot()}")
    PARTS[a.what](a)


if __name__ == "__main__":
    try:
        main()
    except sluice.errors.SluiceError as e:  # a missing or bad model file: its message, not a traceback
        sys.exit(f"knobs.py: {e}")
