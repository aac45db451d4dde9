"""acquire_parts.py in the bench's shape: a fresh process (no expert planned yet: every miss is a first one), a
32-token prompt, then the 9 decode steps after the first timed (issue-30 model, --memory 640MiB, O_DIRECT, no
ceiling, 2 threads): perf_counter around StreamingExpertStore.acquire, its _submit and _victim, the reader's planning
of an expert missed the first time (DirectReader.template before plan.c, template_at after), its submit_templates and
the native pool's hand-off (NativePool.submit_ops before, submit_templates after); ms per token, and calls per token
(#). Wraps whichever of those the tree it runs in has; where the store plans every expert at its first miss (_plan),
also the prompt's time and that planning in it.

    PYTHONPATH=. .venv/bin/python benchmarks/results/hybrid/acquire_fresh.py MODEL [native|uring]
"""
import sys
import time

import sluice
from sluice.io import direct, native_pool
from sluice.store.streaming import StreamingExpertStore

acc = {}


def wrap(cls, name, label):
    orig = getattr(cls, name, None)
    if orig is None:
        return

    def f(*a, **k):
        t = time.perf_counter()
        r = orig(*a, **k)
        acc[label] = acc.get(label, 0.0) + time.perf_counter() - t
        acc[label + "#"] = acc.get(label + "#", 0) + 1
        return r

    setattr(cls, name, f)


wrap(StreamingExpertStore, "acquire", "acquire")
wrap(StreamingExpertStore, "_submit", "_submit")
wrap(StreamingExpertStore, "_victim", "_victim")
wrap(direct.DirectReader, "template", "plan")
wrap(direct.DirectReader, "template_at", "plan")
wrap(direct.DirectReader, "submit_templates", "submit_templates")
wrap(native_pool.NativePool, "submit_ops", "pool")
wrap(native_pool.NativePool, "submit_templates", "pool")
wrap(StreamingExpertStore, "_plan", "plan_all")
eng = sys.argv[2] if len(sys.argv) > 2 else "native"
m = sluice.load(sys.argv[1], memory="640MiB", io="direct", odirect=True, prefetch="none", threads=2, max_context=512,
                io_engine=eng)
g = m.generate_tokens(list(range(100, 132)), max_tokens=10, temperature=0.0)
t0 = time.perf_counter()
next(g)
if "plan_all" in acc:
    print(f"prompt and first token {(time.perf_counter() - t0) * 1000:.0f} ms, of it planning every expert's reads "
          f"{acc['plan_all'] * 1000:.1f} ms")
acc.clear()
t0 = time.perf_counter()
n = sum(1 for _ in g)
w = (time.perf_counter() - t0) / n * 1000
print(eng, f"{n} tokens {w:.1f} ms/token;",
      ", ".join(f"{k} {v / n * (1 if k.endswith('#') else 1000):.2f}" for k, v in acc.items()))
