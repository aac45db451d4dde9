"""In-process A/B of the streaming store's decode path in C (store/stream_native.py NativeStream: an acquire, and a
guess's reads, one C call each) against its Python path (the same slot table in C, the reads queued from Python, the
guessed reads as Python futures), on one model's greedy stream after [5, 6] (40 tokens skipped): each round, each arm
switched on, one token untimed, 16 timed, arm order rotated per round (benchmarks/common.py alternate_tokens), so both
see the same machine moments and the same store. The two make the same choices and reads (tests/store/
test_stream_native.py). --memory 640MiB, O_DIRECT, no cgroup; MODE as benchmarks/common.py decode_options (auto:
--prefetch auto).

    .venv/bin/python benchmarks/results/hybrid/stream_ab.py auto ROUNDS MODEL
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

import sluice  # noqa: F401 - before torch (its OpenMP threads)
from benchmarks.common import alternate_tokens, decode_stream, print_paired

mode, rounds, M = sys.argv[1], int(sys.argv[2]), sys.argv[3]
m, it = decode_stream(M, mode)
store = m.store
kept = {}


def python() -> None:
    if store._stream:
        store._land_stream()  # its guessed reads land: Python's path from here
        kept["stream"] = store._stream
    store._stream = False


def native() -> None:
    store._stream = kept.get("stream")  # None: made again at the next acquire


res = alternate_tokens(it, {"python": python, "C": native}, rounds)
print_paired(res, "python", "C", f"{mode} {{arm}}", "with C")
s = store.stats()
print(f"hits {s['hits']} misses {s['misses']} prefetch issued {s['prefetch_issued']} used {s['prefetch_used']}")
it.close()
m.close()
