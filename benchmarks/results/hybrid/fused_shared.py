"""In-process A/B of a decode fusion on the issue-30 model: every MoE block's `fused` (the shared expert in the
routed experts' call, db10c9f, layers/moe.py MoE._fused_shared), every Gated DeltaNet or gated attention layer's
`fused` (its mixer in one call, native/layer.c), or the store's victims at once (policy.victims) on / off, alternated every 16 tokens of one greedy run (arm order rotated per round; one
token after each switch untimed), so both arms see the same machine moments. Resident ("all") or streamed
(--memory M, O_DIRECT, no cgroup).

    .venv/bin/python benchmarks/results/hybrid/fused_shared.py all 16 [shared|deltanet|attention]
    .venv/bin/python benchmarks/results/hybrid/fused_shared.py 640MiB 16 [shared|deltanet|attention|victims]
"""
import sluice, sys, time, gc, statistics, torch
from sluice.models.layers.gated_deltanet import GatedDeltaNet
from sluice.models.layers.moe import MoE
M = "benchmarks/models/qwen3_5_moe-a3b-8GiB/model-Q4_K_M.gguf"
mem = sys.argv[1] if len(sys.argv) > 1 else "all"
kw = dict(memory="all") if mem == "all" else dict(memory=mem, io="direct", odirect=True)
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
res = {True: [], False: []}
it = m.generate_tokens([5, 6], max_tokens=1100, temperature=0.0, stop_at_eos=False)
for _ in range(40): next(it)
for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 16):
    for on in ((True, False) if r % 2 else (False, True)):
        setf(on)
        next(it)
        t = time.perf_counter()
        for _ in range(16): next(it)
        res[on].append((time.perf_counter() - t) / 16 * 1e3)
for on in (True, False):
    v = res[on]; print(f"{mem} {kind.__name__} fused={on}: median {statistics.median(v):.2f} ms/token, min {min(v):.2f}, mean {statistics.mean(v):.2f}")
d = [a - b for a, b in zip(res[True], res[False])]
print(f"paired diff (fused - separate): median {statistics.median(d):+.2f} ms, {sum(x < 0 for x in d)}/{len(d)} rounds faster")
