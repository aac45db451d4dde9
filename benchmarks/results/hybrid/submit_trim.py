"""DirectReader.submit_templates before and after its trim (the version before, 0d2f38c's, reconstructed here as
`before`: its per-template lists, its ctypes array, the fd -> path map made each call), alternated in one process on
one reader: the same 8 experts' templates of a layer into 8 slots, each call's reads landed before the next; median
us per call of 400 calls per arm, 5 rounds. The streamed model of MODEL (--memory 640MiB, O_DIRECT, --prefetch auto)
after 3 tokens (every expert's reads planned).

    .venv/bin/python benchmarks/results/hybrid/submit_trim.py [MODEL]
"""
import ctypes, gc, statistics, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import sluice
from benchmarks.common import HYBRID_Q4, decode_options
from sluice.errors import CheckpointError
from sluice.io import native_pool
from sluice.io.base import done_future

M = sys.argv[1] if len(sys.argv) > 1 else HYBRID_Q4
m = sluice.load(M, threads=2, max_context=300, **decode_options("auto"))
for _ in m.generate_tokens([5, 6], max_tokens=3, temperature=0.0, stop_at_eos=False):
    pass
store = next(o for o in gc.get_objects() if type(o).__name__ == "StreamingExpertStore")
r = store.reader


def before(self, items):  # 0d2f38c's DirectReader.submit_templates with its NativePool.submit_templates inlined
    try:
        for path in dict.fromkeys(p for t, _ in items for p in t.paths):
            self._pool.guard.check(path, self._pool.fd(path)[0])
    except CheckpointError as e:
        return [done_future(self._counters, e) for _ in items]
    live = [(t, base) for t, base in items if len(t.ends)]
    with self._pool.lock:
        paths = {fd: path for path, (fd, _) in self._pool.fds.items()}
        for t, _ in items:  # add_counts' per-batch loop
            self._counters.add_counts([t.counts])
        desc, ats = [v for t, base in live for v in (*t.desc, base)], [native_pool.OpReads(t.ops, paths) for t, _ in live]
        pool = self._pool.native
        n = len(ats)
        handles = (ctypes.c_void_p * n)()
        native_pool.LIB.sluice_io_submit_templates(pool.handle, (ctypes.c_int64 * len(desc))(*desc), n, handles)
        futs = iter([native_pool.NativeFuture(pool.counters, h, at, None) for h, at in zip(handles, ats)])
    return [next(futs) if len(t.ends) else done_future(self._counters) for t, _ in items]


raw0, stride = store.raw.data_ptr(), store.raw.stride(0)


def arm(fn):
    ts = []
    for i in range(400):
        items = [(store._templates[(i % 40, e)], raw0 + s * stride) for e, s in zip(range(8), range(8))]
        t0 = time.perf_counter()
        futs = fn(items)
        ts.append(time.perf_counter() - t0)
        for f in futs:
            f.result()
    return statistics.median(ts) * 1e6


res = {"before": [], "after": []}
for rnd in range(5):
    for name in (("before", "after") if rnd % 2 == 0 else ("after", "before")):
        res[name].append(arm((lambda items: before(r, items)) if name == "before" else r.submit_templates))
for name, v in res.items():
    print(f"{name}: median {statistics.median(v):.1f} us a call of 8 templates (rounds: {', '.join(f'{x:.1f}' for x in v)})")
