"""Memory the streaming store's read templates take (io/direct.py ReadTemplate): after a 2-token prompt and N decode
tokens of the issue-30 model streamed (O_DIRECT, --memory 640MiB), the experts planned so far and the bytes their
templates hold (each template's own op array (or view and its share of a layer's array) and object, its key and the
dict; the parts shared between templates counted once), by sys.getsizeof.

    .venv/bin/python benchmarks/results/hybrid/template_bytes.py [MODEL] [N]
"""

import sys

import sluice  # before torch
from sluice.engine import load

model = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/models/qwen3_5_moe-a3b-8GiB/model-Q4_K_M.gguf"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 48
m = load(model, memory="640MiB", io="direct", odirect=True, prefetch="none", threads=2, max_context=n + 16)
list(m.generate_tokens([5, 6], max_tokens=n, temperature=0.0))
ts = m.store._templates
# each template's own objects (its key, itself, its op array or view, its descriptor), and the op arrays a layer's
# templates view (io/direct.py templates_at, after 95a4aaf: one array a layer), each counted once
own = sum(sys.getsizeof(k) + sys.getsizeof(t) + sys.getsizeof(t.ops) + sys.getsizeof(getattr(t, "desc", ()))
          for k, t in ts.items()) + sys.getsizeof(ts)
own += sum(b.nbytes for b in {id(t.ops.base): t.ops.base for t in ts.values() if t.ops.base is not None}.values())
shared = {id(x): x for t in ts.values() for x in (t.dests, t.ends, t.counts, t.paths)}
shared_bytes = sum(sys.getsizeof(x) for x in shared.values())
print(f"{sluice.__file__}: {n} tokens: {len(ts)} of {m.layout.total_experts} experts planned; {own / 2**20:.2f} MiB "
      f"their own ({own / max(1, len(ts)):.0f} bytes each), {len(shared)} shared parts {shared_bytes} bytes")
