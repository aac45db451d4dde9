"""Time the expert math per quantized format and kernel; picks sluice.quant.kernels' choices (INT4_MAX_ROWS, ...).

    python benchmarks/quant_kernels.py [--threads 1] [--rounds 15] [--out benchmarks/results/quant_kernels]

One expert = y = down(silu(gate(x)) * up(x)), weights [I, H], [I, H], [H, I], for H x I in {2048 x 768
(Qwen3-30B-A3B), 1024 x 512} and T in {1, 4, 128} rows. Arms (all in one process, interleaved A B C ... per round,
after one untimed warm-up round; medians over rounds):
- dense bf16 / dense f32: F.linear on resident weights (what sluice computes from a bf16 checkpoint today);
- Q4_K int4 op: torch's packed int4 matmul (aten._weight_int4pack_mm_for_cpu) on the prepared slot;
- Q4_K int4 deq: the same packed slot dequantized into a float32 scratch + float32 F.linear (the many-rows path);
- <fmt> affine: the slot holds unpacked codes + float32 scales; scales applied into the float32 scratch + F.linear
  (the exact path, and the bf16 path for formats without an int4 fit);
- <fmt> affine->bf16: the same, the scratch rounded to bf16 and a bf16 F.linear (to justify the float32 scratch);
- <fmt> raw deq: the stored bytes dequantized on every call (ggml.dequantize into the scratch) + F.linear, i.e.
  no prepare step;
- int8pack: aten._weight_int8pack_mm (per-output-channel scales only: Q8_0's per-32 scales do not fit it; timed as
  a bound on what an int8 kernel would give).
Also: prepare() per kernel (ms per expert and bytes allocated, from torch.profiler), the op's own repacking
(codes -> int32 -> aten._convert_weight_to_int4pack_for_cpu -> copy into the slot) against ours from the stored
nibbles (int4pack.pack_nibbles), the int4 op on MLX 4-bit weights per group size 32 / 64 / 128, and each
kernel's relative L2 error against F.linear on the exact float32 dequantized weights (x float32, 4 rows).
The machine is shared: the load average and the busiest processes are written next to the numbers, and with one
thread the times are this thread's CPU time (time.thread_time), which excludes the time other processes held the
core; --clock wall gives wall time (what a quiet machine should be re-measured with).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from sluice.quant import ggml, int4pack  # noqa: E402
from sluice.quant.spec import AffineKernel, Int4PackKernel, QuantSpec  # noqa: E402
from tests.quant.samples import random_stored  # noqa: E402

SHAPES = [(2048, 768), (1024, 512)]
ROWS = [1, 4, 128]


class Projection:
    """One projection's stored bytes and every prepared form the arms need."""

    def __init__(self, fmt: str, out_f: int, in_f: int, seed: int):
        self.spec = QuantSpec.ggml(fmt, out_f, in_f)
        self.raw = random_stored(self.spec, seed)
        self.exact = self.spec.dequantize(self.raw)  # float32 [out, in]
        self.affine = AffineKernel(self.spec, torch.float32)
        self.affine_slot = self.affine.prepare(self.raw, torch.empty(self.affine.nbytes, dtype=torch.uint8))
        if fmt in ("Q4_K", "Q4_0"):
            self.int4 = Int4PackKernel(self.spec, torch.bfloat16)
            self.int4_slot = self.int4.prepare(self.raw, torch.empty(self.int4.nbytes, dtype=torch.uint8))
        self.dense_bf16 = self.exact.bfloat16()


def arms(scratch: torch.Tensor, scratch_bf16: torch.Tensor) -> dict:
    """name -> (format, dtype of x, fn(x, projection) -> y); int8pack is run separately."""
    def int4_op(x, p):
        v = p.int4.views(p.int4_slot)
        return int4pack.mm(x, v["packed"], 32, v["sz"])

    def int4_deq(x, p):
        return F.linear(x.float(), p.int4.dequantize(p.int4_slot, scratch)).bfloat16()

    def affine(x, p):
        return p.affine.linear(x, p.affine_slot, scratch)

    def affine_bf16(x, p):
        w = scratch_bf16[: p.affine.scratch_numel].view(p.exact.shape)
        w.copy_(p.affine.dequantize(p.affine_slot, scratch))
        return F.linear(x, w)

    def raw_deq(x, p):
        n = p.affine.scratch_numel
        w = ggml.dequantize(p.spec.parts[0].view(p.raw), p.spec.name, out=scratch[:n]).view(p.exact.shape)
        return F.linear(x.float(), w)

    return {
        "dense bf16": ("Q4_K", torch.bfloat16, lambda x, p: F.linear(x, p.dense_bf16)),
        "dense f32": ("Q4_K", torch.float32, lambda x, p: F.linear(x, p.exact)),
        "Q4_K int4 op": ("Q4_K", torch.bfloat16, int4_op),
        "Q4_K int4 deq": ("Q4_K", torch.bfloat16, int4_deq),
        "Q4_K affine": ("Q4_K", torch.float32, affine),
        "Q4_K affine->bf16": ("Q4_K", torch.bfloat16, affine_bf16),
        "Q4_K raw deq": ("Q4_K", torch.float32, raw_deq),
        "Q6_K affine": ("Q6_K", torch.float32, affine),
        "Q6_K raw deq": ("Q6_K", torch.float32, raw_deq),
        "Q5_K affine": ("Q5_K", torch.float32, affine),
        "Q8_0 affine": ("Q8_0", torch.float32, affine),
        "Q8_0 raw deq": ("Q8_0", torch.float32, raw_deq),
        "int8pack": ("Q8_0", torch.bfloat16, None),
    }


CLOCK = time.perf_counter  # set by main: thread CPU time with one thread (see --clock)


def timed(fn) -> float:
    """ms of fn by CLOCK. With one torch thread every op runs on this thread, so its CPU time is the work done,
    without the time other processes held the core (the shared dev VM runs at load 8-10 on 2 cores)."""
    t = CLOCK()
    fn()
    return (CLOCK() - t) * 1e3


def load_note() -> str:
    busy = subprocess.run(["ps", "-eo", "pcpu,comm", "--sort=-pcpu"], capture_output=True, text=True).stdout
    top = [line.strip() for line in busy.splitlines()[1:6]]
    return f"loadavg {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f}; busiest: {'; '.join(top)}"


def bench_shape(h: int, i: int, rounds: int) -> dict:
    projs = {fmt: (Projection(fmt, i, h, 1), Projection(fmt, i, h, 2), Projection(fmt, h, i, 3))
             for fmt in ("Q4_K", "Q6_K", "Q5_K", "Q8_0")}
    scratch = torch.empty(h * i)
    scratch_bf16 = torch.empty(h * i, dtype=torch.bfloat16)
    table = arms(scratch, scratch_bf16)
    # int8pack: per-channel int8 weights of the same shapes (a timing bound, not a Q8_0 kernel)
    i8 = [(torch.randint(-127, 128, p.exact.shape, dtype=torch.int8), torch.rand(p.exact.shape[0]).bfloat16())
          for p in projs["Q8_0"]]

    def run(name, x):
        fmt, dtype, fn = table[name]
        if name == "int8pack":
            def lin(xx, k):
                return torch.ops.aten._weight_int8pack_mm(xx, i8[k][0], i8[k][1])
            return lin(F.silu(lin(x, 0)) * lin(x, 1), 2)
        g, u, d = projs[fmt]
        return fn(F.silu(fn(x, g)) * fn(x, u), d)

    result = {}
    for t in ROWS:
        xs = {dt: torch.randn(t, h).to(dt) for dt in (torch.float32, torch.bfloat16)}
        names = list(table)
        if t == 128:
            names.remove("Q4_K raw deq")  # as slow as at 1 row plus the matmul; skip to keep rounds short
        times = {n: [] for n in names}
        for r in range(rounds + 1):
            order = names[r % len(names):] + names[: r % len(names)]  # rotate the order per round
            for n in order:
                x = xs[table[n][1]]
                ms = timed(lambda: run(n, x))
                if r:
                    times[n].append(ms)
        result[t] = {n: statistics.median(v) for n, v in times.items()}
        print(f"H={h} I={i} T={t}: " + ", ".join(f"{n} {v:.2f}" for n, v in result[t].items()), flush=True)
    return result


def crossover(h: int, i: int, rounds: int) -> dict:
    """int4 op vs int4 deq per row count on one [I, H] projection (INT4_MAX_ROWS)."""
    p = Projection("Q4_K", i, h, 1)
    scratch = torch.empty(h * i)
    v = p.int4.views(p.int4_slot)
    out = {}
    for t in (1, 2, 4, 8, 16, 24, 32, 64, 128):
        x = torch.randn(t, h).bfloat16()
        op, deq = [], []
        for r in range(rounds + 1):
            a = timed(lambda: int4pack.mm(x, v["packed"], 32, v["sz"]))
            b = timed(lambda: F.linear(x.float(), p.int4.dequantize(p.int4_slot, scratch)))
            if r:
                op.append(a)
                deq.append(b)
        out[t] = (statistics.median(op), statistics.median(deq))
        print(f"crossover [{i}x{h}] T={t}: op {out[t][0]:.2f} ms, deq {out[t][1]:.2f} ms", flush=True)
    return out


def mlx_groups(h: int, i: int, rounds: int) -> dict:
    """The int4 op on MLX 4-bit weights per group size (one [I, H] projection, ms) and its weights' error."""
    out = {}
    for group in (32, 64, 128):
        spec = QuantSpec.mlx(4, group, i, h, torch.bfloat16)
        raw = random_stored(spec, 1)
        k = Int4PackKernel(spec, torch.bfloat16)
        slot = k.prepare(raw, torch.empty(k.nbytes, dtype=torch.uint8))
        v = k.views(slot)
        exact = spec.dequantize(raw)
        err = float((k.dequantize(slot, torch.empty(i * h)) - exact).norm() / exact.norm())
        row = {"weights_rel_l2": err, "prepare_ms": statistics.median(
            timed(lambda: k.prepare(raw, slot)) for _ in range(rounds))}
        for t in (1, 4, 32):
            x = torch.randn(t, h).bfloat16()
            row[f"T={t}"] = statistics.median(timed(lambda: int4pack.mm(x, v["packed"], group, v["sz"]))
                                              for _ in range(rounds))
        out[group] = row
        print(f"mlx4 group {group} [{i}x{h}]: {row}", flush=True)
    return out


def allocated_bytes(fn) -> int:
    """Bytes allocated by torch ops inside fn (torch.profiler memory events, positive self allocations)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())


def prepare_costs(h: int, i: int, rounds: int) -> dict:
    out = {}
    cases = [("Q4_K", "int4pack"), ("Q4_K", "affine"), ("Q6_K", "affine"), ("Q5_K", "affine"), ("Q8_0", "affine"),
             ("Q4_0", "int4pack")]
    for fmt, kind in cases:
        p = Projection(fmt, i, h, 1)
        k, slot = (p.int4, p.int4_slot) if kind == "int4pack" else (p.affine, p.affine_slot)
        ptr = slot.data_ptr()
        ms = statistics.median(timed(lambda: k.prepare(p.raw, slot)) for _ in range(rounds))
        assert slot.data_ptr() == ptr
        out[f"{fmt} {kind}"] = {"ms": ms, "alloc_bytes": allocated_bytes(lambda: k.prepare(p.raw, slot)),
                                "slot_bytes": k.nbytes, "stored_bytes": p.spec.nbytes}
        if kind == "int4pack":  # the op's own packing, for comparison
            a = p.spec.affine(p.raw)
            codes = (a.codes + 8).view(torch.uint8) if a.codes.dtype == torch.int8 else a.codes
            qs, _ = p.spec.nibbles(p.raw)
            dst = k.views(slot)["packed"]

            def via_op():
                dst.copy_(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))

            def ours():
                int4pack.pack_nibbles(qs, dst)
            out[f"{fmt} packing only: ours, from the stored nibbles"] = {
                "ms": statistics.median(timed(ours) for _ in range(rounds)), "alloc_bytes": allocated_bytes(ours)}
            out[f"{fmt} packing only: torch op, from unpacked codes"] = {
                "ms": statistics.median(timed(via_op) for _ in range(rounds)), "alloc_bytes": allocated_bytes(via_op)}
        print(f"prepare [{i}x{h}] {fmt} {kind}: {out[f'{fmt} {kind}']}", flush=True)
    return out


def errors(h: int, i: int) -> dict:
    """Relative L2 of each kernel's y against F.linear(x, exact float32 weights), x float32 [4, H]."""
    x = torch.randn(4, h, generator=torch.Generator().manual_seed(5))
    scratch = torch.empty(h * i)
    out = {}
    for fmt in ("Q4_K", "Q4_0", "Q6_K", "Q8_0"):
        p = Projection(fmt, i, h, 1)
        ref = F.linear(x, p.exact)

        def rel(y):
            return float((y.float() - ref).norm() / ref.norm())
        out[f"{fmt} affine f32"] = rel(p.affine.linear(x, p.affine_slot, scratch))
        bf16 = AffineKernel(p.spec, torch.bfloat16)
        out[f"{fmt} affine bf16-x"] = rel(bf16.linear(x.bfloat16(), p.affine_slot, scratch))
        if fmt in ("Q4_K", "Q4_0"):
            v = p.int4.views(p.int4_slot)
            out[f"{fmt} int4 op"] = rel(int4pack.mm(x.bfloat16(), v["packed"], 32, v["sz"]))
            w4 = p.int4.dequantize(p.int4_slot, torch.empty(i * h))
            out[f"{fmt} int4 weights"] = float((w4 - p.exact).norm() / p.exact.norm())
        out[f"{fmt} dense bf16 weights"] = rel(F.linear(x.bfloat16(), p.dense_bf16))
    return out


def to_markdown(res: dict) -> str:
    """The results as the tables kernels.py quotes."""
    lines = [f"# Quantized expert kernels ({res['cpu']}, int4 layout {res['int4_layout']}, {res['threads']} thread(s), "
             f"{res['clock']} time, median of {res['rounds']} rounds)", "",
             f"Load before: {res['load_before']}", f"Load after: {res['load_after']}", "",
             "## ms per expert, y = down(silu(gate x) * up x)", ""]
    shapes = list(res["experts"])
    head = [f"{s} T={t}" for s in shapes for t in res["experts"][s]]
    lines += ["| arm | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    arms = list(next(iter(next(iter(res["experts"].values())).values())))
    for arm in arms:
        cells = [res["experts"][s][t].get(arm) for s in shapes for t in res["experts"][s]]
        lines.append(f"| {arm} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + " |")
    lines += ["", "## int4 op vs dequantize + f32 matmul, one [768 x 2048] Q4_K projection, ms", "",
              "| rows | op | dequantize + matmul |", "|---|---|---|"]
    lines += [f"| {t} | {op:.2f} | {deq:.2f} |" for t, (op, deq) in res["crossover"].items()]
    lines += ["", "## int4 op on MLX 4-bit per group size, one [768 x 2048] projection", "",
              "| group | T=1 ms | T=4 ms | T=32 ms | prepare ms | weights rel L2 |", "|---|---|---|---|---|---|"]
    lines += [f"| {g} | {r['T=1']:.2f} | {r['T=4']:.2f} | {r['T=32']:.2f} | {r['prepare_ms']:.2f} | "
              f"{r['weights_rel_l2']:.1e} |" for g, r in res["mlx4_groups"].items()]
    for shape, rows in res["prepare"].items():
        lines += ["", f"## prepare() per projection [{shape}]", "",
                  "| what | ms | bytes allocated | slot bytes | stored bytes |", "|---|---|---|---|---|"]
        lines += [f"| {k} | {r['ms']:.2f} | {r['alloc_bytes']} | {r.get('slot_bytes', '-')} | "
                  f"{r.get('stored_bytes', '-')} |" for k, r in rows.items()]
    lines += ["", "## relative L2 against F.linear on the exact float32 weights (x float32, 4 rows)", "",
              "| kernel | rel L2 |", "|---|---|"]
    lines += [f"| {k} | {v:.2e} |" for k, v in res["errors"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "quant_kernels"))
    ap.add_argument("--clock", choices=["cpu", "wall"], default=None,
                    help="thread CPU time (default with --threads 1) or wall time (default otherwise)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = args.clock or ("cpu" if args.threads == 1 else "wall")
    if clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu measures this thread only: use it with --threads 1")
    global CLOCK
    CLOCK = time.thread_time if clock == "cpu" else time.perf_counter
    res = {"threads": args.threads, "rounds": args.rounds, "clock": clock,
           "cpu": torch.backends.cpu.get_cpu_capability(),
           "int4_layout": int4pack._layout(), "load_before": load_note()}
    print(res, flush=True)
    res["experts"] = {f"{h}x{i}": bench_shape(h, i, args.rounds) for h, i in SHAPES}
    res["crossover"] = crossover(2048, 768, args.rounds)
    res["mlx4_groups"] = mlx_groups(2048, 768, args.rounds)
    res["prepare"] = {f"{h}x{i}": prepare_costs(h, i, args.rounds) for h, i in SHAPES[:1]}
    res["errors"] = errors(2048, 768)
    res["load_after"] = load_note()
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(to_markdown(res))
    print(json.dumps(res["errors"], indent=1))
    print(res["load_after"])


if __name__ == "__main__":
    main()
