"""Wall time of a decode token's MoE block and its parts, each wrapped (time.perf_counter around the call), over N
tokens after 8 (a 32-token prompt), 2 threads; MODE as benchmarks/common.py decode_options (resident, stream,
router, auto); PATH "moe.py" (every layer's MoEDecode off: models/layers/moe.py's one-token path, the way before
it) or "MoEDecode" (layers/moe_decode.py: its two native calls, the store's calls around them).

    .venv/bin/python benchmarks/results/hybrid/moe_parts.py MODE PATH N MODEL
"""
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common

import sluice  # noqa: F401 - before torch (its OpenMP threads)
import torch

import sluice.models.layers.moe as M
import sluice.models.layers.moe_decode as MD
import sluice.prerouter.predict as P
import sluice.store.streaming as S
from benchmarks.common import decode_options
from sluice.quant.native import moe_decode as QM, ops

mode, which, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
acc, calls = collections.Counter(), collections.Counter()


def wrap(owner, name, label):
    f = getattr(owner, name)

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t
            calls[label] += 1
    setattr(owner, name, timed)


for name in ("router_probs_bf16", "topk_probs"):
    wrap(M, name, name)
wrap(ops, "combine_bf16", "combine_bf16")
for owner, name in [(M.MoE, "__call__"), (M.Experts, "_native"), (M.Experts, "_one_token"), (M.MoE, "_shared_weight"),
                    (MD.MoEDecode, "__call__"), (QM.DecodeRoute, "__call__"), (QM.DecodeExperts, "run"),
                    (QM.DecodeExperts, "start"), (QM.DecodeExperts, "finish"), (S.StreamingExpertStore, "acquire"),
                    (S.StreamingExpertStore, "issue_deferred"), (S.StreamingExpertStore, "_submit"),
                    (P.RouterPrerouter, "predict")]:
    wrap(owner, name, f"{owner.__name__}.{name}")
m = sluice.load(sys.argv[4], threads=2, max_context=400, **decode_options(mode))
if which == "moe.py":
    for layer in m.model.layers:
        layer.ffn.decode = None
ids = torch.randint(3, 32000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
g = m.generate_tokens(ids, max_tokens=n + 8, temperature=0.0, stop_at_eos=False)
for _ in range(8):
    next(g)
acc.clear()
calls.clear()
t = time.perf_counter()
for _ in g:
    pass
print(f"{mode} {which}: {(time.perf_counter() - t) / n * 1e3:.1f} ms/token over {n} tokens")
for k, v in acc.most_common():
    print(f"  {k:36s} {v / n * 1e3:7.2f} ms/token {calls[k] / n:5.1f} calls {v / calls[k] * 1e6:7.1f} us/call")
g.close()
m.close()
