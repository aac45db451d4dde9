"""Wall and thread CPU (time.thread_time: not counting the time the model's thread waits or is preempted) of the
streamed decode token's main functions on the model's thread, each wrapped, over 80 tokens after 8 (a 32-token
prompt), 2 threads; MODE as benchmarks/common.py decode_options (stream / router / auto / resident); EXTRA: more
sluice.load options as a Python dict literal.

    .venv/bin/python benchmarks/results/hybrid/func_cpu.py auto benchmarks/models/qwen3_5_moe-a3b-8GiB/model-UD-IQ2_XXS.gguf
"""
import sys, time, collections, os
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for benchmarks.common
import sluice, torch
from benchmarks.common import decode_options
m = sluice.load(sys.argv[2], threads=2, max_context=300, **decode_options(sys.argv[1]), **eval(os.environ.get("EXTRA", "{}")))
acc = collections.Counter(); cpu = collections.Counter(); calls = collections.Counter()
def wrap(obj, name, label):
    f = getattr(obj, name)
    def g(*a, **k):
        t, c = time.perf_counter(), time.thread_time()
        try: return f(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t; cpu[label] += time.thread_time() - c; calls[label] += 1
    setattr(obj, name, g)
import sluice.store.streaming as S, sluice.models.layers.moe as M, sluice.prerouter.predict as P, sluice.models.model as MM
import sluice.models.layers.gated_deltanet as GD
try:  # the store's decode path in C (store/stream_native.py)
    import sluice.store.stream_native as SN, sluice.store.stream_decode as SD, sluice.io.template_queue as TQ
    NATIVE_STREAM = [(SN.NativeStream, "prefetch"), (SN.NativeStream, "acquire"), (SD.DecodeStream, "_prefetch_fast"),
                     (SD.DecodeStream, "_acquire_fast"), (TQ.TemplateQueue, "check"), (TQ.TemplateQueue, "adopt")]
except ImportError:
    NATIVE_STREAM = []
try:  # the slot table (0d2f38c): its placements where _victims was the policy's part before
    import sluice.store.slot_table as T
except ImportError:
    T = None
for cls, name in [(S.StreamingExpertStore, "acquire"), (S.StreamingExpertStore, "prefetch"), (S.StreamingExpertStore, "_submit"),
                  (S.StreamingExpertStore, "_victims"), (S.StreamingExpertStore, "_wait"), (S.StreamingExpertStore, "release"),
                  (T and T.NativeSlots, "acquire"), (T and T.NativeSlots, "prefetch"), (T and T.NativeSlots, "used"),
                  (M.MoE, "__call__"), (M.Experts, "_native"), (P.RouterPrerouter, "predict"), (GD.GatedDeltaNet if hasattr(GD, "GatedDeltaNet") else None, "__call__")] + NATIVE_STREAM:
    if cls is None or not hasattr(cls, name): continue  # what the checkout has
    wrap(cls, name, f"{cls.__name__}.{name}")
ids = torch.randint(3, 32000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
g = m.generate_tokens(ids, max_tokens=88, temperature=0.0, stop_at_eos=False)
for i in range(8): next(g)
acc.clear(); cpu.clear(); calls.clear(); t = time.perf_counter(); c0 = time.thread_time()
for tok in g: pass
w = time.perf_counter() - t; n = 80
print(sys.argv[1], f"{w/n*1e3:.1f} ms/token wall, main thread CPU {(time.thread_time()-c0)/n*1e3:.1f}")
for k, v in acc.most_common(): print(f"  {k:40s} wall {v/n*1e3:6.2f}  thread CPU {cpu[k]/n*1e3:6.2f} ms/token  {calls[k]/n:5.1f} calls")
