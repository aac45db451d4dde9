"""The prompt-path settings of issue 15's last changes, each measured against its alternatives (one model, quiet).

    .venv/bin/python benchmarks/prefill/knobs.py wait    [--model GGUF] [--rounds 6] [--prompts 128 512 2048]
    .venv/bin/python benchmarks/prefill/knobs.py blocks  [--model FOLDER] [--rounds 6] [--prompts 512 2048]
    .venv/bin/python benchmarks/prefill/knobs.py dequant [--rounds 15]
    .venv/bin/python benchmarks/prefill/knobs.py profile [--model GGUF] [--prompts 2048]
    .venv/bin/python benchmarks/prefill/knobs.py int8    [--rounds 15]
    .venv/bin/python benchmarks/prefill/knobs.py gemm    [--rounds 15]
    .venv/bin/python benchmarks/prefill/knobs.py attend  [--rounds 15] [--prompts 2048]
    .venv/bin/python benchmarks/prefill/knobs.py code    [--model GGUF] [--rounds 6] [--prompts 2048]
    .venv/bin/python benchmarks/prefill/knobs.py reads   [--model GGUF] [--rounds 6] [--prompts 2048]

wait: the native pool's wait between a prompt's jobs (native.PROMPT_WAIT) at 1 ms / 200 us / 50 us of spin + yield,
alternated in one process on resident prompts (rotated order, a new seeded prompt each run), medians of prefill ms;
then decode ms/token with the decode wait against the prompt's.
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
attend: a prompt's causal attention (8 query / 2 kv heads of 128) in native/attend.c against matmul.sdpa, alternated,
median ms of rounds of 10; and the relative error of each against float64.
code: at --activations int8, a layer's rows coded once for all its experts (Transformer.code_rows_once) against each
expert coding its own, resident, alternated in one process (a new seeded prompt each run), medians of prefill ms.
reads: a prompt's read-ahead in batches of 4 experts (streaming.PROMPT_READ_GROUP) against one expert a batch,
streamed (--io direct --odirect --memory 512MiB, int8), alternated in one process: medians of prefill ms and of the
reader's reads per prompt.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
from pathlib import Path

import sluice  # noqa: F401  before torch: sluice sets torch's OpenMP wait policy
import torch

ROOT = Path(__file__).resolve().parent.parent.parent
PEERS_Q4 = ROOT / "benchmarks" / "models" / "qwen3_moe-peers" / "model-Q4_K_M.gguf"
DEMO_1G = ROOT / "benchmarks" / "models" / "qwen3_moe-1GiB"


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def wait(a) -> None:
    from sluice.quant import native

    arms = {"1 ms": (50_000, 1_000_000), "200 us": (50_000, 200_000), "50 us": (50_000, 50_000)}
    names = list(arms)
    with sluice.load(a.model, memory="all") as m:
        list(m.generate_tokens(_prompt(64, 1), max_tokens=1, stop_at_eos=False))
        for n in a.prompts:
            res: dict[str, list[float]] = {k: [] for k in names}
            for r in range(a.rounds):
                for k in names[r % 3 :] + names[: r % 3]:
                    native.PROMPT_WAIT = arms[k]
                    list(m.generate_tokens(_prompt(n, 1000 * r + names.index(k) + 7 + n), max_tokens=1,
                                           stop_at_eos=False))
                    res[k].append(m.stats()["prefill_ms"])
            print(f"{n} tokens, prefill ms (median of {a.rounds}): "
                  + ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in res.items()))
        native.PROMPT_WAIT = arms["200 us"]
        decode: dict[str, list[float]] = {"decode wait": [], "prompt wait": []}
        for r in range(a.rounds):
            for k in (list(decode) if r % 2 == 0 else list(decode)[::-1]):
                native.DECODE_WAIT = (50_000, 1_000_000) if k == "decode wait" else native.PROMPT_WAIT
                list(m.generate_tokens(_prompt(16, 5000 + 2 * r + (k == "prompt wait")), max_tokens=24,
                                       stop_at_eos=False))
                decode[k].append(1000 * statistics.median(m.step_times.decode_s[4:]))
        print(f"decode ms/token (median of {a.rounds}): "
              + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in decode.items()))


def blocks_child(model: str, n: int, split: bool) -> list[float]:
    from sluice.quant import matmul

    if not split:
        matmul.GEMM_BLOCK_BYTES = matmul.GEMM_MIN_BLOCK = 1 << 40
    out = []
    with sluice.load(model) as m:
        for i in range(3):
            list(m.generate_tokens(_prompt(n, 100 + i), max_tokens=1, stop_at_eos=False))
            out.append(m.stats()["prefill_ms"])
    return out


def blocks(a) -> None:
    for n in a.prompts:
        res: dict[str, list[list[float]]] = {"one GEMM": [], "row blocks": []}
        for r in range(a.rounds):
            for k in (list(res) if r % 2 == 0 else list(res)[::-1]):
                cmd = [sys.executable, __file__, "blocks-child", "--model", str(a.model), "--prompts", str(n)]
                if k == "row blocks":
                    cmd.append("--split")
                res[k].append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True)
                                         .stdout.splitlines()[-1]))
        print(f"{n} tokens, prefill ms of a fresh process's 1st / 2nd / 3rd prompt (medians of {a.rounds}): "
              + "; ".join(f"{k} " + " / ".join(f"{statistics.median(x[i] for x in v):.0f}" for i in range(3))
                          for k, v in res.items()))


def dequant(a) -> None:
    from sluice.quant import native
    from sluice.quant.spec import QuantSpec
    from sluice.quant.native.kernel import bf16_view

    native.set_threads(1)
    g = torch.Generator().manual_seed(0)
    specs = [QuantSpec.ggml("Q4_K", 1024, 1024), QuantSpec.ggml("Q6_K", 1024, 512)]
    raws = [torch.randint(0, 255, (s.nbytes,), dtype=torch.uint8, generator=g) for s in specs]
    scratch = torch.empty(1024 * 1024)
    outs = {"bf16": lambda s: bf16_view(scratch, s.out_features * s.in_features),
            "float32": lambda s: scratch[: s.out_features * s.in_features]}
    def one(out):
        for s, raw in zip(specs, raws):
            native.dequantize(s, raw, out(s))

    ms = _median_ms({name: functools.partial(one, out) for name, out in outs.items()}, a.rounds, 50, warm=20)
    for name, v in ms.items():
        print(f"dequantize one expert to {name}: {v:.3f} ms (one thread)")


def profile(a) -> None:
    import cProfile
    import pstats

    with sluice.load(a.model, memory="all") as m:
        n = a.prompts[0]
        list(m.generate_tokens(_prompt(n, 1), max_tokens=1, stop_at_eos=False))
        pr = cProfile.Profile()
        pr.enable()
        list(m.generate_tokens(_prompt(n, 2), max_tokens=1, stop_at_eos=False))
        pr.disable()
        print(f"{n}-token prompt, prefill {m.stats()['prefill_ms']:.0f} ms under cProfile; seconds by function:")
        stats = pstats.Stats(pr).stats
        top = sorted(((v[2], k[2]) for k, v in stats.items()), reverse=True)[:10]
        for sec, name in top:
            print(f"  {sec:.3f}  {name}")


def int8(a) -> None:
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    a8 = torch.randint(-100, 100, (256, 1024), dtype=torch.int8, generator=g)
    b8 = torch.randint(-100, 100, (1024, 1024), dtype=torch.int8, generator=g)
    x, w = torch.randn(256, 1024, generator=g).bfloat16(), torch.randn(1024, 1024, generator=g).bfloat16()
    fns = {"bf16 F.linear": lambda: F.linear(x, w), "int8 torch._int_mm": lambda: torch._int_mm(a8, b8)}
    for name, ms in _median_ms(fns, a.rounds, 30, warm=5).items():
        print(f"{name}: {ms:.3f} ms ({2 * 256 * 1024 * 1024 / ms / 1e6:.0f} GOP/s)")


def _median_ms(fns: dict, rounds: int, reps: int, warm: int = 3) -> dict[str, float]:
    """{name: median ms of `rounds` rounds of `reps` calls}, the functions alternated within each round, each called
    `warm` times first."""
    import time

    for f in fns.values():
        for _ in range(warm):
            f()
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t = time.perf_counter()
            for _ in range(reps):
                fns[k]()
            ts[k].append((time.perf_counter() - t) / reps)
    return {k: 1000 * statistics.median(v) for k, v in ts.items()}


def gemm(a) -> None:
    import torch.nn.functional as F

    from sluice.quant import native
    from sluice.quant.spec import QuantSpec
    from sluice.quant.native import prompt
    from tests.quant.samples import random_stored

    native.set_threads(2)
    for fmt, n, k in (("Q4_K", 1024, 1024), ("Q4_K", 1024, 512)):
        spec = QuantSpec.ggml(fmt, n, k)
        raw = random_stored(spec, seed=1)
        x = torch.randn(256, k, generator=torch.Generator().manual_seed(2)).bfloat16()
        y, w = torch.empty(256, n), torch.empty(n, k, dtype=torch.bfloat16)
        ms = _median_ms({"int8 (prompt.c)": lambda: prompt.linears([(spec, raw, y)], x),
                         "dequantize + bf16 GEMM": lambda: F.linear(x, native.dequantize(spec, raw, w)),
                         "bf16 GEMM alone": lambda: F.linear(x, w)}, a.rounds, 30)
        print(f"{fmt} [256 x {k}] @ [{k} x {n}]: " + ", ".join(f"{name} {v:.3f} ms" for name, v in ms.items()))


def attend(a) -> None:
    import torch.nn.functional as F

    from sluice.quant.matmul import sdpa
    from sluice.quant import native
    from sluice.quant.native import attend as native_attend

    if not native_attend.available():
        sys.exit("knobs.py attend: needs the native extension and a CPU with AVX512_BF16")
    native.set_threads(2)
    n = a.prompts[0]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(h, n, 128, generator=g).bfloat16() for h in (8, 2, 2))
    outs = {"attend.c": lambda: native_attend.causal(q, k, v, 0),
            "matmul.sdpa": lambda: sdpa(q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0]
            .transpose(0, 1).reshape(n, -1)}
    ref = F.scaled_dot_product_attention(q[None].double(), k[None].double(), v[None].double(), is_causal=True,
                                         enable_gqa=True)[0].transpose(0, 1).reshape(n, -1)
    ms = _median_ms(outs, a.rounds, 10)
    for name, f in outs.items():
        err = float((f().double() - ref).norm() / ref.norm())
        print(f"{n} tokens, 8 / 2 heads of 128, causal: {name} {ms[name]:.1f} ms, relative error {err:.2e}")


def code(a) -> None:
    arms = {"coded once a layer": True, "coded per expert": False}
    with sluice.load(a.model, memory="all", activations="int8") as m:
        list(m.generate_tokens(_prompt(64, 1), max_tokens=1, stop_at_eos=False))
        res: dict[str, list[float]] = {k: [] for k in arms}
        for r in range(a.rounds):
            for i, k in enumerate(list(arms) if r % 2 == 0 else list(arms)[::-1]):
                m.model.code_rows_once = arms[k]
                list(m.generate_tokens(_prompt(a.prompts[0], 100 * r + i + 3), max_tokens=1, stop_at_eos=False))
                res[k].append(m.stats()["prefill_ms"])
        print(f"{a.prompts[0]} tokens, prefill ms (median of {a.rounds}): "
              + ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in res.items()))


def reads(a) -> None:
    from sluice.store import streaming

    arms = {"4 experts a batch": 4, "1 expert a batch": 1}
    with sluice.load(a.model, memory="512MiB", io="direct", odirect=True, activations="int8") as m:
        list(m.generate_tokens(_prompt(64, 1), max_tokens=1, stop_at_eos=False))
        ms: dict[str, list[float]] = {k: [] for k in arms}
        n_reads: dict[str, list[int]] = {k: [] for k in arms}
        for r in range(a.rounds):
            for i, k in enumerate(list(arms) if r % 2 == 0 else list(arms)[::-1]):
                streaming.PROMPT_READ_GROUP = arms[k]
                before = m.reader.stats()["reads"]
                list(m.generate_tokens(_prompt(a.prompts[0], 100 * r + i + 5), max_tokens=1, stop_at_eos=False))
                ms[k].append(m.stats()["prefill_ms"])
                n_reads[k].append(m.reader.stats()["reads"] - before)
        print(f"{a.prompts[0]} tokens, streamed (median of {a.rounds}): "
              + ", ".join(f"{k} {statistics.median(ms[k]):.0f} ms, {statistics.median(n_reads[k]):.0f} reads"
                          for k in arms))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["wait", "blocks", "dequant", "profile", "int8", "gemm", "attend", "code",
                                     "reads", "blocks-child"])
    ap.add_argument("--model")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--prompts", type=int, nargs="+")
    ap.add_argument("--split", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.what == "blocks-child":
        print(json.dumps(blocks_child(a.model, a.prompts[0], a.split)))
        return
    a.model = a.model or str(DEMO_1G if a.what == "blocks" else PEERS_Q4)
    a.rounds = a.rounds or (6 if a.what in ("wait", "blocks", "code", "reads") else 15)
    a.prompts = a.prompts or {"wait": [128, 512, 2048], "blocks": [512, 2048]}.get(a.what, [2048])
    {"wait": wait, "blocks": blocks, "dequant": dequant, "profile": profile, "int8": int8, "gemm": gemm,
     "attend": attend, "code": code, "reads": reads}[a.what](a)


if __name__ == "__main__":
    try:
        main()
    except sluice.errors.SluiceError as e:  # a missing or bad model file: its message, not a traceback
        sys.exit(f"knobs.py: {e}")
