"""The gated delta rule over a prompt at Qwen3.5 / 3.6's linear-attention shapes (32 value heads, 16 key heads tiled
to them, 128 x 128 state), one 2,048-token prompt in DELTA_SLICE slices of 256, 2 threads, bf16 inputs (the model's
dtype): the torch steps (models/layers/delta_rule.py `chunked`, q and k repeated to the value heads first as
gated_deltanet.py does) against the native call (native/delta_prompt.py, with the unrepeated q and k; on this CPU's
best kernel and on the AVX2 one, `path=AVX2`), and against another tree's chunked when its delta_rule.py is given as
a file (`git show REV:sluice/models/layers/delta_rule.py > old.py`); alternated, ms per layer, median of 5 rounds.
Then each arm's float32 output for one slice against a float64 run of chunked (relative to the largest value), the
CPU, the kernel, and the machine's state (probe.py's GEMM) before and after. Output: delta_rule_timing_native.txt.

    .venv/bin/python benchmarks/results/hybrid/delta_rule_timing.py [old.py]    (a worktree: PYTHONPATH=. first)
"""

import importlib.util
import pathlib
import statistics
import subprocess
import sys
import time

import sluice  # noqa: F401  before torch, as the engine (OpenMP wait policy)
import torch

from sluice.models.layers import delta_rule
from sluice.quant import native
from sluice.quant.native.delta_prompt import DeltaRulePrompt

PROBE = [sys.executable, str(pathlib.Path(__file__).with_name("probe.py"))]
torch.set_num_threads(2)
native.set_threads(2)
T, NK, HV, D, SLICE = 2048, 16, 32, 128, 256


def _old():
    if len(sys.argv) < 2:
        return None
    spec = importlib.util.spec_from_file_location("sluice.models.layers.old_delta_rule", sys.argv[1])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(T, NK, D, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(T, HV, D, generator=g).to(dtype)
    gg, beta = -torch.rand(T, HV, generator=g), torch.rand(T, HV, generator=g).to(dtype)
    return q, k, v, gg, beta


def _arms(dtype, old):
    """name -> fn(q, k, v, g, beta, state) taking the unrepeated q and k (tiled: value head j reads key head j % NK)"""
    tiled = lambda rule: lambda q, k, *rest: rule(q.repeat(1, HV // NK, 1), k.repeat(1, HV // NK, 1), *rest)  # noqa
    arms = {"torch": tiled(delta_rule.chunked), "native": DeltaRulePrompt(NK, HV, D, D, dtype, tiled=True),
            "avx2": DeltaRulePrompt(NK, HV, D, D, dtype, tiled=True, path=native.AVX2)}  # what an AVX2-only CPU runs
    if old is not None:
        arms["old"] = tiled(old.chunked)
    return arms


def _run(fn, inputs, T_=T, state=None):
    state = torch.zeros(HV, D, D, dtype=torch.float32) if state is None else state
    outs = []
    t = time.perf_counter()
    for i in range(0, T_, SLICE):
        outs.append(fn(*(x[i : i + SLICE] for x in inputs), state))
    return (time.perf_counter() - t) * 1000, torch.cat(outs).float()


def main():
    print(subprocess.run(PROBE, capture_output=True, text=True).stdout.strip(), "(before)")
    old = _old()
    inputs = _inputs(torch.bfloat16)
    arms = _arms(torch.bfloat16, old)
    times = {name: [] for name in arms}
    for _ in range(5):
        outs = {}
        for name, fn in arms.items():
            ms, outs[name] = _run(fn, inputs)
            times[name].append(ms)
    med = {name: statistics.median(v) for name, v in times.items()}
    for name, v in times.items():
        print(f"{name:>6}: {med[name]:.0f} ms a layer (rounds {[round(x) for x in v]})")
    print(f"torch / native: {med['torch'] / med['native']:.2f}x; torch / avx2: {med['torch'] / med['avx2']:.2f}x")
    ref = outs["torch"]
    diff = (outs["native"] - ref).abs().max().item() / ref.abs().max().item()
    print(f"bf16 outputs, native against torch, largest difference relative to the largest: {diff:.1e}; "
          f"native's bits on the avx2 path: {torch.equal(outs['native'], outs['avx2'])}")
    f32 = _inputs(torch.float32)
    exact = _run(_float64, f32, SLICE, torch.zeros(HV, D, D, dtype=torch.float64))[1]
    for name, fn in _arms(torch.float32, old).items():
        out = _run(fn, f32, SLICE)[1]
        print(f"float32, one slice, {name} against float64 chunked: {_rel(out, exact):.1e}")
    print(f"native kernel: {arms['native'].isa}; CPU: {_cpu()}")
    print(subprocess.run(PROBE, capture_output=True, text=True).stdout.strip(), "(after)")


def _float64(q, k, v, g, beta, state):
    r = HV // NK
    q, k = q.double().repeat(1, r, 1), k.double().repeat(1, r, 1)
    return delta_rule.chunked(q, k, v.double(), g.double(), beta.double(), state)


def _rel(x, ref) -> float:
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


def _cpu() -> str:
    info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    fields = dict(line.split(":", 1) for line in info if ":" in line)
    flags = fields.get("Flags", "").split()
    simd = [f for f in flags if f.startswith(("avx", "fma", "f16c"))]
    return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs, {' '.join(simd)}"


if __name__ == "__main__":
    main()
