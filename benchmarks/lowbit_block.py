"""The low-bit super-block kernels of two source trees, side by side: each type's AVX2 row kernel at one x row
(decode), alone in a C harness (benchmarks/lowbit_block.c: no Python, no pool, no x coding in the timing), built with
setup.py's flags against REV's q8_low.c / q8_iq.h / lowbit.c and against the working tree's, the two binaries run
alternately `rounds` times; per type the best time of each (us per [N x K] call, thread CPU time) and whether both
computed the same bits (a hash of the outputs). For a change to these kernels' code that should not change bits:

    .venv/bin/python benchmarks/lowbit_block.py REV [--types IQ2_XXS,Q3_K] [--rounds 5] [--reps 2000]

The weights are random valid blocks with sane f16 scales (tests/quant/samples.py random_stored) and x a Gaussian row
coded by sluice's quantizer in one plane (the --activations int8 coding the low-bit files get by default).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from sluice.host.cpus import cpu_line, describe_cpu  # noqa: E402
from sluice.quant.native._lib import LIB, desc  # noqa: E402
from sluice.quant.native.q8 import _layout_of  # noqa: E402
from sluice.quant.spec import QuantSpec  # noqa: E402
from tests.quant.samples import random_stored  # noqa: E402

NATIVE = "sluice/quant/native"
SOURCES = ["q8_low.c", "q8_iq.h", "lowbit.c", "lowbit.h", "q8.h", "common.h", "iq_grids.h"]
TYPES = ["Q2_K", "Q3_K", "TQ1_0", "TQ2_0", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]
FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-std=c11"]  # setup.py's


def build(src: Path, out: Path) -> Path:
    exe = out / "lowbit_block"
    subprocess.run(["gcc", *FLAGS, f"-I{src}", str(ROOT / "benchmarks/lowbit_block.c"), str(src / "q8_low.c"),
                    str(src / "lowbit.c"), "-lm", "-o", str(exe)], check=True)
    return exe


def tree_at(rev: str, out: Path) -> Path:
    """REV's copies of the kernels' sources in out/src."""
    src = out / "src"
    src.mkdir()
    for name in SOURCES:
        blob = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{NATIVE}/{name}"], capture_output=True,
                              check=True).stdout
        (src / name).write_bytes(blob)
    return src


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", help="the git revision to compare the working tree against")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--shapes", default="2048x512,768x2048",
                    help="N x K of the projections (K a multiple of 256; a K of 4+ blocks also checks the bits of the "
                         "float lanes' adds, which a K of two blocks, one per lane set, leaves untouched)")
    a = ap.parse_args()
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{a.rev}^{{commit}}"],
                      capture_output=True).returncode:
        ap.error(f"{a.rev!r} is not a commit of {ROOT}")
    if bad := [t for t in a.types.split(",") if t not in TYPES]:
        ap.error(f"--types: {', '.join(bad)} not among the 256-value types this harness times ({', '.join(TYPES)})")
    try:
        shapes = [tuple(map(int, sh.split("x"))) for sh in a.shapes.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(sh) != 2 or sh[0] < 1 or sh[1] < 256 or sh[1] % 256 for sh in shapes):
        ap.error(f"--shapes {a.shapes!r}: N x K pairs (e.g. 2048x512), K a multiple of 256")
    work = Path(tempfile.mkdtemp())
    (work / "old").mkdir()
    (work / "new").mkdir()
    old, new = build(tree_at(a.rev, work / "old"), work / "old"), build(ROOT / NATIVE, work / "new")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    print(f"# {a.rev} against the working tree (on {head}); CPU: {cpu_line(describe_cpu())}")
    print(f"# one x row, one plane; best of {a.reps} calls, {a.rounds} alternating rounds; us of thread CPU time")
    print(f"{'type':8s} {'shape':>9s} {a.rev:>10s} {'tree':>10s}  ratio  bits")
    for n, k in shapes:
        shape = f"{n}x{k}"
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(2))
        xf = _layout_of(QuantSpec.ggml("Q2_K", n, k), 1)  # one plane in super-blocks (q8.h SB1), every 256-value type
        xq = torch.empty(LIB.sluice_q8_row_bytes(k, xf), dtype=torch.uint8)
        LIB.sluice_quantize_q8(k, x.data_ptr(), 1, xq.data_ptr(), xf, 0)
        (work / "x.bin").write_bytes(xq.numpy().tobytes())
        for name in a.types.split(","):
            spec = QuantSpec.ggml(name, n, k)
            raw = random_stored(spec, seed=1)
            fmt = desc(spec, raw)[0]
            w = work / f"{name}.bin"
            w.write_bytes(raw.numpy().tobytes())
            args = [str(fmt), str(n), str(k), str(w), str(work / "x.bin"), str(a.reps)]
            best, hashes = {"old": 1e30, "new": 1e30}, {}
            for _ in range(a.rounds):
                for arm, exe in (("old", old), ("new", new)):
                    us, h = subprocess.run([str(exe), *args], capture_output=True, text=True, check=True).stdout.split()
                    best[arm] = min(best[arm], float(us))
                    hashes[arm] = h
            same = "same" if hashes["old"] == hashes["new"] else "differ"
            print(f"{name:8s} {shape:>9s} {best['old']:10.1f} {best['new']:10.1f}  {best['new'] / best['old']:.2f}x  "
                  f"{same}", flush=True)


if __name__ == "__main__":
    main()
