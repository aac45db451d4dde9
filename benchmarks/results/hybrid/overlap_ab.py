"""In-process A/B of a streamed decode token's MoE block queueing the next layer's guessed reads while the native
pool's workers start on its experts (layers/moe_decode.py: DecodeExperts.start, the store's issue_deferred, finish)
against the same calls one after the other (start replaced by run, the reads queued after it: the way MoEDecode
went before); one model, its greedy stream after [5, 6] (40 tokens skipped), 16 timed tokens an arm a round (one
untimed after each switch), arm order rotated (benchmarks/common.py alternate_tokens). The same bits either way.
MODE as benchmarks/common.py decode_options (router or auto: guesses to queue).

    .venv/bin/python benchmarks/results/hybrid/overlap_ab.py MODE ROUNDS MODEL
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

import sluice  # noqa: F401 - before torch (its OpenMP threads)
from benchmarks.common import alternate_tokens, decode_stream, print_paired
from sluice.quant.native.moe_decode import DecodeExperts

mode, rounds = sys.argv[1], int(sys.argv[2])
m, it = decode_stream(sys.argv[3], mode)
start, finish = DecodeExperts.start, DecodeExperts.finish


def one_after_the_other(self, raw, slots, x, w, at, out):
    self.run(raw, slots, list(range(len(slots))), x, True, True, len(slots), w, at, out)


def arm(overlap: bool):
    def switch():
        DecodeExperts.start = start if overlap else one_after_the_other
        DecodeExperts.finish = finish if overlap else (lambda self: None)
    return switch


res = alternate_tokens(it, {"sync": arm(False), "overlap": arm(True)}, rounds)
print_paired(res, "sync", "overlap", mode + " {arm}", "overlap")
arm(True)()
it.close()
m.close()
