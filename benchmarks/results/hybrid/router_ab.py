"""In-process A/B of a decode token's router logits over the native threads (decode.c sluice_router_probs_bf16's
tasks, the default) against the model's thread alone (the loop before), in the model: the true router's
probabilities (models/layers/moe.py router_probs_bf16) and the guess (decode.Guess), the rest of the step the same.
The single-thread arm calls the same functions in a second copy of the extension loaded beside the first (its own
pool, never given threads: pool_run runs every task on the caller); both give the same bits (tests/quant/
test_decode.py), so one greedy stream after [5, 6] (40 skipped) serves both: per round each arm switches on, one
token untimed, 16 timed (benchmarks/common.py alternate_tokens, arms rotated). MODE as benchmarks/common.py
decode_options.

    .venv/bin/python benchmarks/results/hybrid/router_ab.py auto ROUNDS [MODEL]
"""
import ctypes
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

import sluice  # noqa: F401 - before torch (its OpenMP threads)
import sluice.models.layers.moe as moe
import sluice.quant.native.decode as decode
from benchmarks.common import HYBRID_Q4, alternate_tokens, decode_stream, print_paired

mode, rounds = sys.argv[1], int(sys.argv[2])
M = sys.argv[3] if len(sys.argv) > 3 else HYBRID_Q4
copy = Path(tempfile.mkdtemp()) / "kernels_copy.so"
shutil.copy(importlib.util.find_spec("sluice.quant.native._kernels").origin, copy)
one = ctypes.CDLL(str(copy))  # its own pool: 1 thread
for name in ("sluice_router_probs_bf16", "sluice_guess_bf16"):
    f, g = getattr(decode._LIB, name), getattr(one, name)
    g.argtypes, g.restype = f.argtypes, f.restype
m, it = decode_stream(M, mode)
pooled = (moe.router_probs_bf16, decode.Guess.__call__)


def serial_probs(x, router, *, path=decode.BEST):
    lib, decode._LIB = decode._LIB, one
    try:
        return pooled[0](x, router, path=path)
    finally:
        decode._LIB = lib


def serial_guess(self, x):
    lib, decode._LIB = decode._LIB, one
    try:
        return pooled[1](self, x)
    finally:
        decode._LIB = lib


def arm(serial: bool):
    def f():
        moe.router_probs_bf16 = serial_probs if serial else pooled[0]
        decode.Guess.__call__ = serial_guess if serial else pooled[1]
    return f


res = alternate_tokens(it, {"one thread": arm(True), "pool": arm(False)}, rounds)
print_paired(res, "one thread", "pool", f"{mode} router logits on {{arm}}", "on the pool")
it.close()
m.close()
