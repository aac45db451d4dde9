"""In-process A/B of a streamed decode layer's store calls and experts as one native call (store/stream.c
sluice_stream_layer through StreamingExpertStore.run_layer: the acquire, the experts while the guess's reads are
queued, the release) against the same steps as separate calls (store.acquire, DecodeExperts.start, issue_deferred,
finish, release: each a C call of its own with the store's Python between), on one model's greedy stream after
[5, 6] (40 tokens skipped): each round, each arm switched on, one token untimed, 16 timed, arm order rotated per round
(benchmarks/common.py alternate_tokens). --memory 640MiB, O_DIRECT, no cgroup; MODE as benchmarks/common.py
decode_options (auto: --prefetch auto). Prints how many layers took the one call.

    .venv/bin/python benchmarks/results/hybrid/fused_ab.py auto ROUNDS MODEL
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

import sluice  # noqa: F401 - before torch (its OpenMP threads)
from benchmarks.common import alternate_tokens, decode_stream, print_paired
from sluice.models.layers.moe_decode import MoEDecode

mode, rounds, M = sys.argv[1], int(sys.argv[2]), sys.argv[3]
m, it = decode_stream(M, mode)
store = m.store
blocks = []


def find(obj, seen=set()):
    """every MoEDecode reachable from the model (its layers' feed-forward blocks)"""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, MoEDecode):
        blocks.append(obj)
        return
    items = obj.__dict__.values() if hasattr(obj, "__dict__") else obj if isinstance(obj, (list, tuple)) else ()
    for v in items:
        if hasattr(v, "__dict__") or isinstance(v, (list, tuple)):
            find(v)


find(m)
fused = {id(b): b.fusable for b in blocks}
ran = [0]
run_layer = store.run_layer


def counting(layer, experts, ctx):
    got = run_layer(layer, experts, ctx)
    ran[0] += got is None
    return got


store.run_layer = counting


def separate() -> None:
    for b in blocks:
        b.fusable = None


def one() -> None:
    for b in blocks:
        b.fusable = fused[id(b)]


res = alternate_tokens(it, {"separate": separate, "one call": one}, rounds)
print_paired(res, "separate", "one call", f"{mode} {{arm}}", "in one call")
s = store.stats()
print(f"{len(blocks)} MoE blocks; layers done in one call: {ran[0]}; hits {s['hits']} misses {s['misses']} "
      f"prefetch issued {s['prefetch_issued']} used {s['prefetch_used']}")
it.close()
m.close()
