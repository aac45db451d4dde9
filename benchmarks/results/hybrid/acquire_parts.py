"""Where a streamed decode token's expert acquires spend the model thread's wall time (issue-30 model, --memory 640MiB,
O_DIRECT, no ceiling, 2 threads; 8 warm-up tokens, then 40 timed): perf_counter around StreamingExpertStore.acquire,
its _submit and _victim, DirectReader.template (template_at after 57657b3: planning an expert's reads the first time
it is missed) and submit_templates, NativePool.submit_ops (submit_templates after 57657b3: the C call and the
futures); ms per token, and calls per token x 1000 (#).

    .venv/bin/python benchmarks/results/hybrid/acquire_parts.py MODEL [native|uring]
"""
import time, sys
import sluice
from sluice.store.streaming import StreamingExpertStore
from sluice.io import native_pool, direct
acc = {}
def wrap(cls, name):
    orig = getattr(cls, name, None)
    if orig is None:  # the tree it runs in has the other name (57657b3: template_at, NativePool.submit_templates)
        return
    def f(*a, **k):
        t = time.perf_counter(); r = orig(*a, **k); acc[name] = acc.get(name, 0.0) + time.perf_counter() - t; acc[name + "#"] = acc.get(name + "#", 0) + 1; return r
    setattr(cls, name, f)
wrap(StreamingExpertStore, "acquire"); wrap(StreamingExpertStore, "_submit")
wrap(direct.DirectReader, "submit_templates"); wrap(native_pool.NativePool, "submit_ops")
wrap(StreamingExpertStore, "_victim"); wrap(direct.DirectReader, "template")
wrap(direct.DirectReader, "template_at")
if not hasattr(native_pool.NativePool, "submit_ops"):  # after 57657b3 the pool's hand-off (under another label)
    orig_pool = native_pool.NativePool.submit_templates
    def pool_submit(*a, **k):
        t = time.perf_counter(); r = orig_pool(*a, **k)
        acc["submit_ops"] = acc.get("submit_ops", 0.0) + time.perf_counter() - t
        acc["submit_ops#"] = acc.get("submit_ops#", 0) + 1
        return r
    native_pool.NativePool.submit_templates = pool_submit
eng = sys.argv[2] if len(sys.argv) > 2 else "native"
m = sluice.load(sys.argv[1], memory="640MiB", io="direct", odirect=True, prefetch="none", threads=2, max_context=200,
                io_engine=eng)
ids = [5, 6]
list(m.generate_tokens(ids, max_tokens=8, temperature=0.0))
acc.clear()
t0 = time.perf_counter(); n = 40
list(m.generate_tokens(ids, max_tokens=n, temperature=0.0))
w = (time.perf_counter() - t0) / n * 1000
print(eng, f"{w:.1f} ms/token;", ", ".join(f"{k} {v / n * 1000:.2f}" for k, v in acc.items()), "ms/token")
