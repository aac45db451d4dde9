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
--int8: only the integer path (quant/native/q8.c) against the float row kernel, T in {1, 4}, both shapes, Q4_K /
Q6_K / Q8_0 / Q4_0: ms per [I, H] projection (native.linear vs native.linear_q8 with 2 and 1 planes, x float32)
and per expert at bf16 as models/experts.py runs it (three NativeKernel calls on the float kernel, as before the
integer path; three on the integer path; native.expert_q8's one call, 2 and 1 planes); written as the "Integer
path" section of OUT.md (the rest of the file is kept) and OUT_int8.json.
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
from sluice.quant.spec import AffineKernel, Int4PackKernel, QuantSpec  # noqa: E402
from sluice.quant.native.kernel import NativeKernel  # noqa: E402
from tests.quant.samples import random_stored  # noqa: E402

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


def int8_bench(rounds: int) -> dict:
    """name -> ms for the --int8 section (see the module docstring)."""
    out = {}
    for h, i in ((1024, 512), (2048, 768)):
        for fmt in ("Q4_K", "Q6_K", "Q8_0", "Q4_0"):
            e = Expert(fmt, h, i)
            g, u, d = e.specs
            fl = [NativeKernel(s, torch.bfloat16) for s in e.specs]
            for k in fl:
                k.int8 = False  # the float row kernel at bf16: what ran before the integer path
            i8 = [NativeKernel(s, torch.bfloat16) for s in e.specs]
            scratch = torch.empty(h * i)

            def three(ks, x, e=e):
                lin = [lambda v, k=k, r=r: k.linear(v, r, scratch) for k, r in zip(ks, e.raw)]
                return e.run(lin, x)

            for t in (1, 4):
                x = torch.randn(t, h)
                xb = x.bfloat16()
                arms = {"proj float": lambda: native.linear(g, x, e.raw[0]),
                        "proj int8x2": lambda: native.linear_q8(g, x, e.raw[0]),
                        "proj int8x1": lambda: native.linear_q8(g, x, e.raw[0], planes=1),
                        "expert 3 calls, float kernel": lambda: three(fl, xb),
                        "expert 3 calls, NativeKernel's pick": lambda: three(i8, xb),
                        "expert int8x2, 1 call": lambda: native.expert_q8(e.specs, e.raw, xb.float()).bfloat16(),
                        "expert int8x1, 1 call": lambda: native.expert_q8(e.specs, e.raw, xb.float(),
                                                                          planes=1).bfloat16()}
                out[f"{h}x{i} {fmt} T={t}"] = m = interleaved(arms, rounds)
                print(f"{h}x{i} {fmt} T={t}: " + ", ".join(f"{n} {v:.3f}" for n, v in m.items()), flush=True)
    return out


def int8_markdown(res: dict, rounds: int, load_before: str, load_after: str) -> str:
    names = list(next(iter(res.values())))
    lines = ["## Integer path (benchmarks/native_kernels.py --int8; 1 torch thread, thread CPU time, median of "
             f"{rounds} interleaved rounds, ms)", "", f"Load before: {load_before}", f"Load after: {load_after}", "",
             "proj: one [I, H] projection, x float32 (native.linear = the float row kernel; linear_q8 with 2 / 1 "
             "planes). expert: down(silu(gate x) * up x) from bf16 x, y bf16: three NativeKernel calls on the float "
             "row kernel (what ran before the integer path), three as NativeKernel picks now (integer up to "
             "Q8_MAX_ROWS rows), or native.expert_q8's one call with 2 / 1 planes (what models/experts.py runs up "
             "to EXPERT_Q8_MAX_ROWS rows).", "",
             "| H x I, format, T | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {k} | " + " | ".join(f"{v[n]:.3f}" for n in names) + " |" for k, v in res.items()]
    return "\n".join(lines) + "\n"


def write_int8(res: dict, md: str, out: str) -> None:
    """OUT_int8.json, and md as the "## Integer path" section of OUT.md (replacing an earlier one)."""
    with open(out + "_int8.json", "w") as f:
        json.dump(res, f, indent=1)
    old = open(out + ".md").read() if os.path.exists(out + ".md") else ""
    at = old.find("## Integer path")
    if at >= 0:
        end = old.find("\n## ", at + 1)
        old = old[:at] + (old[end + 1:] if end >= 0 else "")
    with open(out + ".md", "w") as f:
        f.write(old.rstrip("\n") + "\n\n" + md)


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
    ap.add_argument("--rounds", type=int, default=None, help="rounds per measurement (default 11, quick 3, int8 101)")
    ap.add_argument("--int8", action="store_true", help="only the integer path against the float row kernel")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md (default: results/native_kernels, "
                                                "not written with --quick unless given)")
    args = ap.parse_args()
    if not native.native_available():
        sys.exit("the native kernels are not built: pip install -e . (with a C compiler) first")
    torch.set_num_threads(1)
    quant_kernels.CLOCK = time.thread_time
    if args.int8:
        rounds = args.rounds or 101
        before = quant_kernels.load_note()
        res = int8_bench(rounds)
        md = int8_markdown(res, rounds, before, quant_kernels.load_note())
        write_int8(res, md, args.out or os.path.join(os.path.dirname(__file__), "results", "native_kernels"))
        print(md)
        return
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
