"""In-process A/B of a streamed decode layer's late path (some experts' reads not landed at acquire: ~6 of 40 layers
a token of the UD file): the experts in memory started on the pool's workers while the next layer's guessed reads are
queued (DecodeExperts.start_part, then finish) against the reads queued first and the experts run after (the way
before). One model's greedy stream after [5, 6] (40 skipped); each round, each arm switched on, one token untimed, 16
timed, arm order rotated (benchmarks/common.py alternate_tokens). --memory 640MiB, O_DIRECT, --prefetch auto.
Tried and left out (late-ab.txt: no gain): start_part is late_path.patch's, not sluice's.

    git apply benchmarks/results/hybrid/late_path.patch
    .venv/bin/python benchmarks/results/hybrid/late_ab.py ROUNDS MODEL
    git checkout sluice/quant/native/moe_decode.py sluice/models/layers/moe_decode.py tests/quant/test_moe_decode.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

import sluice  # noqa: F401 - before torch (its OpenMP threads)
from benchmarks.common import alternate_tokens, decode_stream, print_paired
from sluice.quant.native.moe_decode import DecodeExperts

rounds, M = int(sys.argv[1]), sys.argv[2]
overlapped = DecodeExperts.start_part


def serial_part(self, raw, slots, rows, x):
    """The experts run after the reads are queued: finish() runs them (the reads queued in between, as before)."""
    self._serial = (raw, slots, rows, x)


serial_finish, plain_finish = None, DecodeExperts.finish


def finish(self):
    part = getattr(self, "_serial", None)
    if part is not None:
        self._serial = None
        self.run(*part, True, True)
        return
    plain_finish(self)


m, it = decode_stream(M, "auto")


def before():
    DecodeExperts.start_part, DecodeExperts.finish = serial_part, finish


def now():
    DecodeExperts.start_part, DecodeExperts.finish = overlapped, plain_finish


res = alternate_tokens(it, {"serial": before, "overlapped": now}, rounds)
print_paired(res, "serial", "overlapped", "auto late path {arm}", "overlapped")
it.close()
m.close()
