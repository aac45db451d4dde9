"""How the streaming store's eviction choice (store/policy.py FairShareLFU.victim) goes on the issue-30 model
streamed without a ceiling (O_DIRECT, --memory 640MiB): which branch each victim takes (the layer at or above its
share evicts its own, under it takes another layer's), the layers' sizes, and how often the layer's least used entry
is pinned by the acquire asking (then the others are asked in order of use).

    .venv/bin/python benchmarks/results/hybrid/victim_paths.py [MODEL]
"""

import collections
import sys

import sluice  # before torch
from sluice.engine import load

model = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/models/qwen3_5_moe-a3b-8GiB/model-Q4_K_M.gguf"
m = load(model, memory="640MiB", io="direct", odirect=True, threads=2, max_context=200)
pol, store = m.store.policy, m.store
paths, least = collections.Counter(), collections.Counter()
victim = pol.victim


def counted(layer, usable):
    own = pol._by_layer[layer]
    if len(own) < pol.quota:
        paths["under its share"] += 1
    else:
        paths["its own"] += 1
        score = pol._score[layer]
        keys = list(own)
        scores = [score[k[1]] for k in keys]
        key = keys[scores.index(min(scores))]
        least["usable" if usable(key, own[key]) else "pinned" if own[key] in store._pinned else "excluded"] += 1
    return victim(layer, usable)


pol.victim = counted
list(m.generate_tokens([5, 6], max_tokens=48, temperature=0.0))
sizes = sorted(len(d) for d in pol._by_layer.values())
print(f"{sluice.__file__}: a 2-token prompt and 48 tokens: {store.n_slots} slots, quota {pol.quota} a layer, layers "
      f"hold {sizes[0]}-{sizes[-1]} (median {sizes[len(sizes) // 2]}); victims from {dict(paths)}; the least used "
      f"entry of the layer was {dict(least)}")
