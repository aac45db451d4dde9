"""Issue 32 item 2: one expert projection of each low-bit GGUF type at T=1 (a decode token), on one thread:

  sluice int16   q8.c / q8_low.c's integer path with two planes of x codes (the default activations)
  sluice int8    the same with one plane (--activations int8, llama.cpp's coding of x)
  torch deq      what these types ran before their kernels: the stored bytes dequantized in torch (bitwise gguf) and
                 one float32 F.linear (quant/linear.py's path without a native kernel)
  llama.cpp      llama.cpp's own CPU kernels on the same bytes: ggml's type traits from the peers' libggml-cpu.so
                 (x to the type's vec_dot type once, vec_dot per weight row: what its mul_mat does for one x row, on
                 one thread), through benchmarks/lowbit_peer.c built here with gcc

Per type and shape, the microseconds of this thread's CPU time per call (CLOCK_THREAD_CPUTIME_ID: every arm runs on
the calling thread, so another process on the machine slows it less than it slows wall time; median over rounds,
arms rotated per round, each round `reps` calls timed together; sluice's through ctypes, ~1 us of call overhead
included; llama.cpp's timed inside C), and each
arm's relative L2 error against F.linear on the exact weights (random blocks with sane f16 scales, a Gaussian x),
which shows every arm computed the same tensor. A second table times the dequantization a prompt's bf16 GEMM runs
on (kernels.dequantize into bf16, [768 x 2048], one thread): the AVX2 path (q8_low.c's unpacking), the portable one
(lowbit.c), and torch's (spec.dequantize, float32). The raw output goes to stdout; the committed copy is
benchmarks/results/lowbit/kernels.txt. Run on a quiet machine:

    PYTHONPATH=. python benchmarks/lowbit_kernels.py [--rounds 7] [--types Q2_K,IQ2_XXS] [--peer-lib PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import alternate  # noqa: E402
from sluice.host.cpus import cpu_line, describe_cpu  # noqa: E402
from sluice.quant.native import AVX2, PORTABLE, dequantize, pool  # noqa: E402
from sluice.quant.native._lib import BEST, LIB, desc  # noqa: E402
from sluice.quant.spec import QuantSpec  # noqa: E402
from tests.quant.samples import random_stored  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TYPES = ["Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ3_XXS", "IQ3_S", "MXFP4", "TQ1_0", "IQ2_XS", "IQ2_S",
         "IQ1_S", "IQ1_M", "TQ2_0", "Q4_K"]  # Q4_K: the kernel sluice had before, for scale
SHAPES = [(2048, 512), (768, 2048)]  # [out, in]: the shape, and Qwen3-30B-A3B's expert gate / up
# llama-cpp-python's libraries in the peers' venv (benchmarks/peers/setup.sh); --peer-lib for another build
PEER_LIB = next(iter(sorted(ROOT.glob("benchmarks/peers/.venv/lib/python*/site-packages/llama_cpp/lib"))),
                ROOT / "benchmarks/peers/.venv")
GGML_TYPE = {"Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ2_XXS": 16, "IQ2_XS": 17, "IQ3_XXS": 18, "IQ1_S": 19,
             "IQ4_NL": 20, "IQ3_S": 21, "IQ2_S": 22, "IQ4_XS": 23, "IQ1_M": 29, "TQ1_0": 34, "TQ2_0": 35, "MXFP4": 39}


class Peer:
    """llama.cpp's CPU kernels through lowbit_peer.c (None-like when its library is missing: `ok` False)."""

    def __init__(self, lib_dir: Path):
        self.ok = (lib_dir / "libggml-cpu.so").exists()
        if not self.ok:
            return
        base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        cpu.ggml_cpu_init()
        self.traits = ctypes.cast(cpu.ggml_get_type_traits_cpu, ctypes.c_void_p).value
        self.row_size = ctypes.cast(base.ggml_row_size, ctypes.c_void_p).value
        so = Path(tempfile.mkdtemp()) / "lowbit_peer.so"
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", str(ROOT / "benchmarks/lowbit_peer.c"), "-o", str(so)],
                       check=True)
        self.lib = ctypes.CDLL(str(so))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self.lib.peer_time.argtypes = [p, p, ctypes.c_int, p, ctypes.c_size_t, i64, i64, p, p, ctypes.c_int, p]
        self.lib.peer_time.restype = ctypes.c_int

    def run(self, name: str, raw: torch.Tensor, spec: QuantSpec, x: torch.Tensor, y: torch.Tensor, reps: int) -> float:
        """us per call over `reps` calls (their mean), y written."""
        ns = (ctypes.c_double * reps)()
        rc = self.lib.peer_time(self.traits, self.row_size, GGML_TYPE[name], raw.data_ptr(),
                                spec.nbytes // spec.out_features, spec.out_features, spec.in_features, x.data_ptr(),
                                y.data_ptr(), reps, ns)
        if rc:
            raise RuntimeError(f"llama.cpp has no CPU vec_dot for {name} (code {rc})")
        return sum(ns) / reps / 1000


def sluice_arm(spec: QuantSpec, raw: torch.Tensor, x: torch.Tensor, y: torch.Tensor, planes: int, reps: int):
    """us per call of LIB.sluice_linear_q8 on all rows, on this thread (x quantized inside the call)."""
    fmt, n, k, q, row_bytes = desc(spec, raw)[:5]
    args = (fmt, n, k, q, row_bytes, None, x.data_ptr(), 1, planes, y.data_ptr(), 0, n, BEST)
    call = LIB.sluice_linear_q8

    def run() -> float:
        t = time.thread_time()
        for _ in range(reps):
            call(*args)
        return 1e6 * (time.thread_time() - t) / reps
    return run


def torch_arm(spec: QuantSpec, raw: torch.Tensor, x: torch.Tensor, out: list, reps: int):
    """us per call of the torch route: dequantize (spec.dequantize, into a kept buffer) + F.linear."""
    buf = torch.empty(spec.out_features * spec.in_features)

    def run() -> float:
        t = time.thread_time()
        for _ in range(reps):
            w = spec.dequantize(raw, out=buf).view(spec.out_features, spec.in_features)
            out[0] = F.linear(x, w)
        return 1e6 * (time.thread_time() - t) / reps
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--peer-lib", type=Path, default=PEER_LIB)
    args = ap.parse_args()
    torch.set_num_threads(1)
    pool.set_threads(1)
    peer = Peer(args.peer_lib)
    print(f"CPU: {cpu_line(describe_cpu())}")
    print(f"load average at start: {Path('/proc/loadavg').read_text().split()[:3]}")
    print(f"torch {torch.__version__}, 1 thread; llama.cpp: {args.peer_lib if peer.ok else 'not found (not measured)'}")
    print(f"median of {args.rounds} rounds, arms rotated; us of thread CPU time per call at T=1 (relative L2 vs the "
          f"exact weights)\n")
    arms = ["sluice int16", "sluice int8", "torch deq", "llama.cpp"] if peer.ok else ["sluice int16", "sluice int8",
                                                                                      "torch deq"]
    print(f"{'type':8s} {'shape':>10s} " + " ".join(f"{a:>20s}" for a in arms) + "   torch/int16  llama/int16")
    for name in args.types.split(","):
        for n, k in SHAPES:
            spec = QuantSpec.ggml(name, n, k)
            raw = random_stored(spec, seed=1)
            x = torch.randn(1, k, generator=torch.Generator().manual_seed(2))
            want = F.linear(x.double(), spec.dequantize(raw).double())
            ys = {a: torch.empty(1, n) for a in arms}
            tout = [None]
            fns = {"sluice int16": sluice_arm(spec, raw, x, ys["sluice int16"], 2, 200),
                   "sluice int8": sluice_arm(spec, raw, x, ys["sluice int8"], 1, 200),
                   "torch deq": torch_arm(spec, raw, x, tout, 10)}
            if peer.ok:
                fns["llama.cpp"] = lambda s=spec, r=raw, y=ys["llama.cpp"], nm=name: peer.run(nm, r, s, x, y, 200)
            for f in fns.values():  # warm-up
                f()
            ys["torch deq"] = tout[0]
            us = {a: statistics.median(v) for a, v in alternate(fns, args.rounds).items()}
            err = {a: float((ys[a].double() - want).norm() / want.norm()) for a in arms}
            cells = " ".join(f"{us[a]:9.1f} ({err[a]:.1e})" for a in arms)
            ratios = f"{us['torch deq'] / us['sluice int16']:10.1f}x"
            if peer.ok:
                ratios += f" {us['llama.cpp'] / us['sluice int16']:11.2f}x"
            print(f"{name:8s} {f'{n}x{k}':>10s} {cells}   {ratios}", flush=True)
    dequant_table(args.types.split(","), args.rounds)
    print(f"\nload average at the end: {Path('/proc/loadavg').read_text().split()[:3]}")


def dequant_table(names: list[str], rounds: int) -> None:
    """ms per [768 x 2048] dequantization into bf16 (AVX2, portable) and torch's float32 one, median of rounds."""
    print(f"\ndequantize [768 x 2048] to bf16 (a prompt's GEMM operand), ms of thread CPU time per call, median of "
          f"{rounds} rounds")
    print(f"{'type':8s} {'avx2':>8s} {'portable':>9s} {'torch f32':>10s}")
    for name in names:
        spec = QuantSpec.ggml(name, 768, 2048)
        raw = random_stored(spec, seed=1)
        out, f32 = torch.empty(768, 2048, dtype=torch.bfloat16), torch.empty(768 * 2048)

        def timed(fn, reps):
            def run() -> float:
                t = time.thread_time()
                for _ in range(reps):
                    fn()
                return 1e3 * (time.thread_time() - t) / reps
            return run
        fns = {"avx2": timed(lambda: dequantize(spec, raw, out, path=AVX2), 20),
               "portable": timed(lambda: dequantize(spec, raw, out, path=PORTABLE), 5),
               "torch": timed(lambda: spec.dequantize(raw, out=f32), 3)}
        ms = {a: statistics.median(v) for a, v in alternate(fns, rounds).items()}
        print(f"{name:8s} {ms['avx2']:8.3f} {ms['portable']:9.3f} {ms['torch']:10.3f}", flush=True)


if __name__ == "__main__":
    main()
