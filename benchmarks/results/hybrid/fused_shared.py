"""In-process A/B of a decode fusion on the issue-30 model: every MoE block's `fused` (the shared expert in the
routed experts' call, db10c9f, layers/moe.py MoE._fused_shared), every Gated DeltaNet or gated attention layer's
`fused` (its mixer in one call, native/layer.c), or the store's victims at once (policy.victims) on / off, alternated every 16 tokens of one greedy run (arm order rotated per round; one
token after each switch untimed), so both arms see the same machine moments. Resident ("all") or streamed
(--memory M, O_DIRECT, no cgroup).

    .venv/bin/python benchmarks/results/hybrid/fused_shared.py all 16 [shared|deltanet|attention]
    .venv/bin/python benchmarks/results/hybrid/fused_shared.py 640MiB 16 [shared|deltanet|attention|victims]
"""
import sys, gc, statistics
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common
import sluice, torch
from benchmarks.common import alternate_tokens
from sluice.models.layers.gated_deltanet import GatedDeltaNet
from sluice.models.layers.moe import MoE
M = "benchmarks/models/qwen3_5_moe-a3b-8GiB/model-Q4_K_M.gguf"
mem = sys.argv[1] if len(sys.argv) > 1 else "all"
kw = dict(memory="all") if mem == "all" else dict(memory=mem, io="direct", odirect=True, prefetch="none")
m = sluice.load(M, threads=2, max_context=1200, **kw)
what = sys.argv[3] if len(sys.argv) > 3 else "shared"
if what == "victims":  # a layer's misses' victims from one sort (policy.victims) vs victim() per miss
    from sluice.store.streaming import StreamingExpertStore as kind
    stores = [o for o in gc.get_objects() if isinstance(o, kind)]
    def setf(on):
        for st in stores:
            if on:
                st.__dict__.pop("_victims", None)
            else:
                st._victims = lambda layer, n, keep=None: None
else:
    from sluice.models.layers.gated_attention import GatedAttention
    kind = {"shared": MoE, "deltanet": GatedDeltaNet, "attention": GatedAttention}[what]
    moes = [o for o in gc.get_objects() if isinstance(o, kind)]
    saved = {id(x): x.fused for x in moes}
    def setf(on):
        for x in moes: x.fused = saved[id(x)] if on else None
it = m.generate_tokens([5, 6], max_tokens=1100, temperature=0.0, stop_at_eos=False)
for _ in range(40): next(it)
res = alternate_tokens(it, {False: lambda: setf(False), True: lambda: setf(True)},
                       int(sys.argv[2]) if len(sys.argv) > 2 else 16)
it.close()
for on in (True, False):
    v = res[on]; print(f"{mem} {kind.__name__} fused={on}: median {statistics.median(v):.2f} ms/token, min {min(v):.2f}, mean {statistics.mean(v):.2f}")
d = [a - b for a, b in zip(res[True], res[False])]
print(f"paired diff (fused - separate): median {statistics.median(d):+.2f} ms, {sum(x < 0 for x in d)}/{len(d)} rounds faster")
