"""In-process A/B of a streamed decode layer's experts still being read run in the store's one native call as their
reads land (store/stream.c sluice_stream_layer with moe_decode.c sluice_moe_experts_part: "in C") against that call
handing such a layer back and the block's Python late path running it (layers/moe_decode.py after acquire: "Python";
the call does that where DecodeExperts.prepared's context has no part function), on one model's greedy stream after
[5, 6] (40 tokens skipped): each round, each arm switched on, one token untimed, 16 timed, arm order rotated per round
(benchmarks/common.py alternate_tokens). --memory 640MiB, O_DIRECT, no cgroup, --prefetch auto. Prints how many
experts each arm ran after waiting in the call.

    git apply benchmarks/results/hybrid/late-c/late_c.patch && .venv/bin/python setup.py build_ext --inplace
    .venv/bin/python benchmarks/results/hybrid/late-c/late_c_ab.py ROUNDS MODEL
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repository root, for benchmarks.common

import sluice  # noqa: F401 - before torch (its OpenMP threads)
from benchmarks.common import alternate_tokens, decode_stream, print_paired
from sluice.quant.native.moe_decode import DecodeExperts

rounds, M = int(sys.argv[1]), sys.argv[2]
m, it = decode_stream(M, "auto")
store = m.store
experts = [o for o in __import__("gc").get_objects() if isinstance(o, DecodeExperts)]
part = experts[0]._ctx[5]
late = {"Python": 0, "in C": 0}
arm = ["in C"]
run_layer = store.run_layer


def counting(layer, ids, ctx):
    got = run_layer(layer, ids, ctx)
    late[arm[0]] += store._stream.late() if got is None else 0
    return got


store.run_layer = counting


def switch(name: str):
    def on() -> None:
        arm[0] = name
        for ex in experts:
            ex._ctx[5] = part if name == "in C" else 0
    return on


res = alternate_tokens(it, {"Python": switch("Python"), "in C": switch("in C")}, rounds)
print_paired(res, "Python", "in C", "auto late experts {arm}", "in C")
print(f"{len(experts)} layers; experts run after a wait in the call: Python {late['Python']}, in C {late['in C']}")
it.close()
m.close()
