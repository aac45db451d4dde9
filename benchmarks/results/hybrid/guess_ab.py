"""In-process A/B of a streamed decode token's guess of the next layer's experts made inside the layer's one native
call (StreamingExpertStore.guess_later: store/stream.c got_guess while the layer's experts start) against the guess
made by the prerouter before the layer (RouterPrerouter.predict, its own native call), on one model's greedy stream
after [5, 6] (40 tokens skipped): each round, each arm switched on, one token untimed, 16 timed, arm order rotated
per round (benchmarks/common.py alternate_tokens). --memory 640MiB, O_DIRECT, no cgroup; MODE as
benchmarks/common.py decode_options (auto: --prefetch auto). Both make the same guesses (tests/store/
test_stream_layer.py).

    .venv/bin/python benchmarks/results/hybrid/guess_ab.py auto ROUNDS MODEL
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

import sluice  # noqa: F401 - before torch (its OpenMP threads)
from benchmarks.common import alternate_tokens, decode_stream, print_paired

mode, rounds, M = sys.argv[1], int(sys.argv[2]), sys.argv[3]
m, it = decode_stream(M, mode)
store = m.store


def before() -> None:
    store.guess_later = None  # models/model.py then calls the prerouter's predict


def inside() -> None:
    store.__dict__.pop("guess_later", None)


res = alternate_tokens(it, {"before": before, "in the call": inside}, rounds)
print_paired(res, "before", "in the call", f"{mode} guess {{arm}}", "in the call")
s = store.stats()
print(f"hits {s['hits']} misses {s['misses']} prefetch issued {s['prefetch_issued']} used {s['prefetch_used']} "
      f"recall {s['prefetch_recall']}")
it.close()
m.close()
