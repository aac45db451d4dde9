"""The C paths of the native kernels, for tests that run each (every wrapper's `path` keyword, common.h's path cap):

  "best"      what this CPU runs by default: its AVX-512 code where it has some (kernels.c's AVX512_BF16 rounding to
              bf16, prompt.c's VNNI tiles, deltanet.c's AVX512F state blocks), else AVX2, else the portable C
  "avx2"      the AVX2 code without the AVX-512 code, as an AVX2-only CPU runs it, so that an AVX-512 CPU tests it too
  "portable"  the scalar C every CPU runs

A model takes its path from LoadOptions.isa (auto / avx2 / portable); the wrappers take it per call, so nothing is
set process-wide for a test to restore.
"""

from __future__ import annotations

import pytest
import torch

from sluice.quant import native
from sluice.quant.native import AVX2, BEST, PORTABLE, prompt
from sluice.quant.native._lib import LIB

PATHS = ("best", "avx2", "portable")
CODES = {"best": BEST, "avx2": AVX2, "portable": PORTABLE}
ISA = {"best": "auto", "avx2": "avx2", "portable": "portable"}  # the same caps as LoadOptions.isa names them
NO_AVX2 = "this CPU has no AVX2 + FMA + F16C: only the portable path runs"


def avx512() -> bool:
    """Whether this CPU runs AVX-512 code of the kernels ("best" differs from "avx2")."""
    return native.available() and bool(LIB.sluice_cpu_avx512f() or LIB.sluice_cpu_avx512bf16()
                                       or prompt.available())


def distinct() -> list[str]:
    """The paths this CPU runs that run different code, portable last: ["portable"] without AVX2, ["avx2",
    "portable"] without AVX-512, all three with it."""
    if not native.simd():
        return ["portable"]
    return (["best"] if avx512() else []) + ["avx2", "portable"]


def code(path: str) -> int:
    """The `path` argument of the wrappers for a path name (skips the test when this CPU does not run it)."""
    if path != "portable" and not native.simd():
        pytest.skip(NO_AVX2)
    return CODES[path]


def on_each(fn, among: list[str] | None = None) -> list:
    """[fn(path) on each path of among (default distinct(): each one that runs different code here)], portable last;
    fn takes the wrappers' `path` argument."""
    return [fn(code(p)) for p in (distinct() if among is None else among)]


def _equal(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else len(a) == len(b) and all(map(_equal, a, b))


def same_bits(outs: list) -> None:
    """Every path gave outs[0]'s bits (outs: on_each's results, tensors or lists of them). Called last in a test:
    where the CPU runs one path only there is nothing to compare it with, and the test says so by skipping after
    its other checks."""
    if len(outs) < 2:
        pytest.skip(f"{NO_AVX2}: no second path to compare its bits with (the other checks ran)")
    assert all(_equal(outs[0], o) for o in outs[1:])
