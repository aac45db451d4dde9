"""In-process A/B of the streaming store's Python against another tree's (BASE: a checkout of the commit before), on
the issue-30 model: StreamingExpertStore.acquire / prefetch, FairShareLFU.victims, RouterPrerouter.predict and
the MoE block's Experts._native taken
from BASE's files (loaded as modules of this package, so everything else is shared) or this tree's, switched every
16 tokens of one greedy run (arm order rotated per round, one token after each switch untimed), so both arms see the
same machine moments. Streamed at --memory 640MiB, O_DIRECT, no cgroup, --prefetch none; `router`: --prefetch router
(benchmarks/common.py decode_options).

    .venv/bin/python benchmarks/results/hybrid/store_ab.py BASE stream 16
    .venv/bin/python benchmarks/results/hybrid/store_ab.py BASE router 16
    .venv/bin/python benchmarks/results/hybrid/store_ab.py BASE auto 16 [MODEL]   # the default read-ahead; a file

Experts._one_token is swapped too (since 2026-12-05).
"""
import importlib.util, statistics, sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

from benchmarks.common import HYBRID_Q4, alternate_tokens, decode_stream
from sluice.models.layers import moe as new_moe
from sluice.prerouter import predict as new_predict
from sluice.store import policy as new_policy, streaming as new_streaming

base, mode = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 16
M = sys.argv[4] if len(sys.argv) > 4 else HYBRID_Q4
if not Path(base, "sluice/store/streaming.py").is_file():
    sys.exit(f"store_ab.py: BASE {base} is not a sluice checkout (no sluice/store/streaming.py): pass a worktree")


def old(name: str, rel: str):
    spec = importlib.util.spec_from_file_location(name, f"{base}/{rel}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


olds = old("sluice.store._base_streaming", "sluice/store/streaming.py")
oldp = old("sluice.store._base_policy", "sluice/store/policy.py")
oldr = old("sluice.prerouter._base_predict", "sluice/prerouter/predict.py")
oldm = old("sluice.models.layers._base_moe", "sluice/models/layers/moe.py")
swaps = [(new_streaming.StreamingExpertStore, n, getattr(olds.StreamingExpertStore, n)) for n in ("acquire", "prefetch")]
swaps += [(new_policy.FairShareLFU, "victims", oldp.FairShareLFU.victims),
          (new_predict.RouterPrerouter, "predict", oldr.RouterPrerouter.predict),
          (new_moe.Experts, "_native", oldm.Experts._native), (new_moe.Experts, "_one_token", oldm.Experts._one_token)]
mine = [(c, n, c.__dict__[n]) for c, n, _ in swaps]


def setf(on: bool) -> None:
    for c, n, f in (mine if on else swaps):
        setattr(c, n, f)


m, it = decode_stream(M, mode)
res = alternate_tokens(it, {False: lambda: setf(False), True: lambda: setf(True)}, rounds)
for on in (True, False):
    v = res[on]
    print(f"{mode} {'this tree' if on else 'base'}: median {statistics.median(v):.2f} ms/token, min {min(v):.2f}, "
          f"mean {statistics.mean(v):.2f}")
it.close()
d = [a - b for a, b in zip(res[True], res[False])]
print(f"paired diff (this - base): median {statistics.median(d):+.2f} ms, {sum(x < 0 for x in d)}/{len(d)} rounds faster")
