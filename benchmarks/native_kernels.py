"""Time the native quantized kernels (sluice/quant/native) per expert against the torch paths; picks NATIVE_MAX_ROWS.

    python benchmarks/native_kernels.py [--quick] [--rounds 11] [--out benchmarks/results/native_kernels]

One expert = y = down(silu(gate(x)) * up(x)), weights [I, H], [I, H], [H, I], for H x I in {2048 x 768
(Qwen3-30B-A3B), 1024 x 512} and T in {1, 4, 32, 128} rows; one torch thread, times are this thread's CPU time
(time.thread_time: the shared dev VM runs other processes; the load is written next to the numbers), median over
rounds, arms interleaved in a rotating order after one untimed warm-up round. Arms:
- dense bf16: F.linear on resident bf16 weights (sluice's bf16 path);
- Q4_K int4 op: torch's packed int4 matmul on the prepared slot (kernels.Int4PackKernel, bf16 compute);
- Q4_K affine: unpacked codes + float32 scales applied into a scratch + float32 matmul (kernels.AffineKernel);
- <fmt> native: NativeKernel.linear from the stored bytes, as StoredLinear runs it (the row kernel up to
  NATIVE_MAX_ROWS rows, native dequantization + float32 matmul above), for Q4_K, Q6_K, Q8_0, Q4_0 and MLX 4-bit
  (group 64, bf16 scales);
plus GB/s of stored weight bytes at T=1, the crossover per projection (row kernel vs native dequantize + matmul
per row count), and the 8 experts of one layer at T=1 on 1 and 2 threads (wall time: the experts spread over
native.Pool(2), or each projection's rows split as native.set_threads(2) does).
--quick: 2048 x 768 only, T in {1, 32}, 3 rounds, crossover at 3 row counts (under a minute on the dev VM).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import quant_kernels  # noqa: E402  (benchmarks/: the load note and the clock)
from sluice.quant import native  # noqa: E402
from sluice.quant.kernels import AffineKernel, Int4PackKernel, QuantSpec  # noqa: E402
from sluice.quant.native.kernel import NativeKernel  # noqa: E402
from sluice.quant.samples import random_stored  # noqa: E402

FORMATS = ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "mlx4"]


def spec_of(fmt: str, out_f: int, in_f: int) -> QuantSpec:
    return QuantSpec.mlx(4, 64, out_f, in_f, torch.bfloat16) if fmt == "mlx4" else QuantSpec.ggml(fmt, out_f, in_f)


class Expert:
    """gate, up, down of one format: stored bytes, and the prepared slots of the torch kernels it is compared with."""

    def __init__(self, fmt: str, h: int, i: int, seed: int = 0):
        self.specs = [spec_of(fmt, i, h), spec_of(fmt, i, h), spec_of(fmt, h, i)]
        self.raw = [random_stored(s, seed + k) for k, s in enumerate(self.specs)]
        self.nbytes = sum(s.nbytes for s in self.specs)
        self.native = [NativeKernel(s, torch.float32) for s in self.specs]
        self.torch = {}
        if fmt == "Q4_K":
            for name, cls, dt in (("int4", Int4PackKernel, torch.bfloat16), ("affine", AffineKernel, torch.float32)):
                ks = [cls(s, dt) for s in self.specs]
                self.torch[name] = [(k, k.prepare(r, torch.empty(k.nbytes, dtype=torch.uint8)))
                                    for k, r in zip(ks, self.raw)]
            self.dense = [s.dequantize(r).bfloat16() for s, r in zip(self.specs, self.raw)]

    def run(self, lin, x):
        g, u, d = lin
        return d(F.silu(g(x)) * u(x))


def expert_arms(experts: dict, scratch: torch.Tensor) -> dict:
    """name -> (dtype of x, fn(x) -> y) for one shape."""
    q = experts["Q4_K"]
    arms = {"dense bf16": (torch.bfloat16, lambda x: q.run([lambda v, w=w: F.linear(v, w) for w in q.dense], x))}
    for name, dt in (("int4 op", torch.bfloat16), ("affine", torch.float32)):
        lin = [lambda v, k=k, s=s: k.linear(v, s, scratch) for k, s in q.torch[name.split()[0]]]
        arms[f"Q4_K {name}"] = (dt, lambda x, lin=lin: q.run(lin, x))
    for fmt, e in experts.items():
        lin = [lambda v, k=k, r=r: k.linear(v, r, scratch) for k, r in zip(e.native, e.raw)]
        arms[f"{fmt} native"] = (torch.float32, lambda x, lin=lin, e=e: e.run(lin, x))
    return arms


def interleaved(fns: dict, rounds: int) -> dict:
    """name -> median ms of fn() over `rounds` rounds (one warm-up), names in a rotating order per round."""
    names, times = list(fns), {n: [] for n in fns}
    for r in range(rounds + 1):
        for n in names[r % len(names):] + names[: r % len(names)]:
            ms = quant_kernels.timed(fns[n])
            if r:
                times[n].append(ms)
    return {n: statistics.median(v) for n, v in times.items()}


def bench_shape(h: int, i: int, rows: list[int], rounds: int) -> dict:
    experts = {fmt: Expert(fmt, h, i) for fmt in FORMATS}
    arms = expert_arms(experts, torch.empty(h * i))
    out = {}
    for t in rows:
        xs = {dt: torch.randn(t, h).to(dt) for dt in (torch.float32, torch.bfloat16)}
        out[t] = interleaved({n: (lambda f=f, x=xs[dt]: f(x)) for n, (dt, f) in arms.items()}, rounds)
        print(f"H={h} I={i} T={t}: " + ", ".join(f"{n} {v:.2f}" for n, v in out[t].items()), flush=True)
    gbs = {fmt: e.nbytes / out[rows[0]][f"{fmt} native"] / 1e6 for fmt, e in experts.items()} if rows[0] == 1 else {}
    return {"ms": out, "gb_per_s_t1": gbs, "expert_bytes": {f: e.nbytes for f, e in experts.items()}}


def crossover(h: int, i: int, rows: list[int], rounds: int) -> dict:
    """Per format and row count, one [I, H] projection: row kernel ms / native dequantize + f32 matmul ms."""
    res = {}
    scratch = torch.empty(h * i)
    for fmt in ("Q4_K", "Q8_0", "mlx4"):
        s = spec_of(fmt, i, h)
        raw = random_stored(s)
        res[fmt] = {}
        for t in rows:
            x = torch.randn(t, h)
            m = interleaved({"rows": lambda: native.linear(s, x, raw),
                             "deq+mm": lambda: F.linear(x, native.dequantize(s, raw, scratch))}, rounds)
            res[fmt][t] = (m["rows"], m["deq+mm"])
        print(f"crossover {fmt}: " + ", ".join(f"T={t} {a:.2f}/{b:.2f}" for t, (a, b) in res[fmt].items()),
              flush=True)
    return res


def threads(h: int, i: int, rounds: int) -> dict:
    """The 8 experts of one layer at T=1 (Q4_K), wall ms: sequential on this thread; the experts spread over
    native.Pool(2); each projection's rows split over 2 threads (native.set_threads(2), what NativeKernel does)."""
    experts = [Expert("Q4_K", h, i, seed=3 * k) for k in range(8)]
    x = torch.randn(1, h)
    pool = native.Pool(2)

    def expert(e, split=False):
        g, u, d = ((lambda v, s=s, r=r: pool.linear(s, v, r)) if split else (lambda v, s=s, r=r: native.linear(s, v, r))
                   for s, r in zip(e.specs, e.raw))
        return d(F.silu(g(x)) * u(x))

    arms = {"1 thread": lambda: [expert(e) for e in experts],
            "experts on 2 threads": lambda: pool.run([lambda e=e: expert(e) for e in experts]),
            "rows split over 2": lambda: [expert(e, True) for e in experts]}
    clock = quant_kernels.CLOCK
    try:
        quant_kernels.CLOCK = time.perf_counter  # two threads: wall time
        m = interleaved(arms, rounds * 3)
        # and the CPU time of all the process's threads: equal to one thread's means no work added by the split,
        # so on two idle cores the wall time would halve (the loaded dev VM cannot show that in wall time)
        quant_kernels.CLOCK = time.process_time
        cpu = interleaved(arms, rounds * 3)
    finally:
        quant_kernels.CLOCK = clock
        pool.close()
    m.update({f"{n} cpu": v for n, v in cpu.items()})
    m["speedup experts"] = m["1 thread"] / m["experts on 2 threads"]
    m["speedup rows"] = m["1 thread"] / m["rows split over 2"]
    print(f"8 experts T=1: {m}", flush=True)
    return m


def to_markdown(res: dict) -> str:
    lines = ["# Native quantized kernels (benchmarks/native_kernels.py"
             f"{' --quick' if res['quick'] else ''}; {res['cpu']}, simd={res['simd']}, 1 torch thread, "
             f"thread CPU time, median of {res['rounds']})", "",
             f"Load before: {res['load_before']}", f"Load after: {res['load_after']}", "",
             "## ms per expert, y = down(silu(gate x) * up x)", ""]
    for shape, r in res["experts"].items():
        rows = list(r["ms"])
        lines += [f"### H x I = {shape}", "", "| arm | " + " | ".join(f"T={t}" for t in rows) + " |",
                  "|---" * (len(rows) + 1) + "|"]
        for arm in r["ms"][rows[0]]:
            lines.append(f"| {arm} | " + " | ".join(f"{r['ms'][t][arm]:.2f}" for t in rows) + " |")
        if r["gb_per_s_t1"]:
            lines += ["", "GB/s of stored weight bytes at T=1 (native): " + ", ".join(
                f"{f} {g:.1f} ({r['expert_bytes'][f] / 1e6:.2f} MB)" for f, g in r["gb_per_s_t1"].items())]
        lines.append("")
    lines += ["## One [I, H] projection: row kernel / native dequantize + f32 matmul, ms", ""]
    for fmt, r in res["crossover"].items():
        lines.append(f"- {fmt}: " + ", ".join(f"T={t} {a:.2f} / {b:.2f}" for t, (a, b) in r.items()))
    t = res["threads"]
    lines += ["", f"## 8 Q4_K experts at T=1, wall ms: 1 thread {t['1 thread']:.2f}; experts on native.Pool(2) "
              f"{t['experts on 2 threads']:.2f} ({t['speedup experts']:.2f}x); each projection's rows split over 2 "
              f"threads {t['rows split over 2']:.2f} ({t['speedup rows']:.2f}x). CPU ms of all threads: "
              f"{t['1 thread cpu']:.2f} / {t['experts on 2 threads cpu']:.2f} / {t['rows split over 2 cpu']:.2f}", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one shape, T=1 and 32, 3 rounds: under a minute")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per measurement (default 11, quick 3)")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md (default: results/native_kernels, "
                                                "not written with --quick unless given)")
    args = ap.parse_args()
    if not native.native_available():
        sys.exit("the native kernels are not built: pip install -e . (with a C compiler) first")
    torch.set_num_threads(1)
    quant_kernels.CLOCK = time.thread_time
    rounds = args.rounds or (3 if args.quick else 11)
    shapes, rows = ([(2048, 768)], [1, 32]) if args.quick else ([(2048, 768), (1024, 512)], [1, 4, 32, 128])
    cross_rows = [1, 32, 64] if args.quick else [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    res = {"quick": args.quick, "rounds": rounds, "cpu": torch.backends.cpu.get_cpu_capability(),
           "simd": native.simd(), "load_before": quant_kernels.load_note()}
    print(res, flush=True)
    res["experts"] = {f"{h}x{i}": bench_shape(h, i, rows, rounds) for h, i in shapes}
    res["crossover"] = crossover(*shapes[0], cross_rows, rounds)
    res["threads"] = threads(*shapes[0], rounds)
    res["load_after"] = quant_kernels.load_note()
    out = args.out or (None if args.quick else os.path.join(os.path.dirname(__file__), "results", "native_kernels"))
    md = to_markdown(res)
    if out:
        with open(out + ".json", "w") as f:
            json.dump(res, f, indent=1)
        with open(out + ".md", "w") as f:
            f.write(md)
    print(md)


if __name__ == "__main__":
    main()
