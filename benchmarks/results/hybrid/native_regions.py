"""Where the model thread's decode token goes on the issue-30 model: time inside native calls (a proxy over the
extension's ctypes functions times each call: the kernels and the pool's split, both threads' work) against the
wall time of regions (wrapped methods: a layer, its mixer, the MoE block, its experts, the shared expert, norms,
residual adds; streamed also the store's acquire / waits); "other" is a region's time outside native calls: Python,
torch ops, waits. 8 tokens after a 32-token prompt untimed, then 40 timed per pass. The proxy adds ~1 us a call.

    .venv/bin/python benchmarks/results/hybrid/native_regions.py resident   # everything in memory
    .venv/bin/python benchmarks/results/hybrid/native_regions.py stream     # --memory 640MiB, O_DIRECT, no cgroup
    .venv/bin/python benchmarks/results/hybrid/native_regions.py router     # the same with --prefetch router
    .venv/bin/python benchmarks/results/hybrid/native_regions.py resident benchmarks/models/qwen3_5_moe-a3b-8GiB/model-UD-IQ2_XXS.gguf
"""
import sluice, time, sys, torch, collections, importlib, threading
from sluice.quant.native import _lib
acc = collections.Counter(); cnt = collections.Counter()
main = threading.get_ident()
class P:
    def __init__(s, lib): s._lib = lib; s._c = {}
    def __getattr__(s, n):
        f = getattr(s._lib, n)
        if not callable(f) or n.startswith('_'): return f
        w = s._c.get(n)
        if w is None:
            def w(*a, _f=f, _n=n):
                t = time.perf_counter(); r = _f(*a); acc[_n] += time.perf_counter() - t; cnt[_n] += 1; return r
            s._c[n] = w
        return w
proxy = P(_lib.LIB)
import pkgutil, sluice.quant.native as nat
for m in [x for x in pkgutil.iter_modules(nat.__path__) if not x.name.startswith('_')]:
    mod = importlib.import_module('sluice.quant.native.' + m.name)
    for nm in ('LIB', '_LIB'):
        if getattr(mod, nm, None) is _lib.LIB: setattr(mod, nm, proxy)
Q = sys.argv[2] if len(sys.argv) > 2 else "benchmarks/models/qwen3_5_moe-a3b-8GiB/model-Q4_K_M.gguf"
mode = sys.argv[1] if len(sys.argv) > 1 else 'resident'
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))  # the repository root
from benchmarks.common import decode_options
m = sluice.load(Q, threads=2, max_context=300, **decode_options(mode))  # stream: --prefetch none
ids = torch.randint(3, 32000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
N = 40
def run(n):
    out = []
    t = time.perf_counter()
    for i, tok in enumerate(m.generate_tokens(ids, max_tokens=n, temperature=0.0, stop_at_eos=False)):
        if i == 7:
            acc.clear(); cnt.clear(); t = time.perf_counter()
            if 'reg' in globals(): reg.clear(); regn.clear()
    return time.perf_counter() - t
try:
    wall = run(N + 8)
except TypeError as e:
    print(e); raise
n = N
tot = sum(acc.values())
print(f"{mode}: {wall/n*1e3:.1f} ms/token wall; in native calls {tot/n*1e3:.1f} ms; calls/token {sum(cnt.values())/n:.0f}")
for k, v in acc.most_common(20): print(f"  {k:32s} {v/n*1e3:6.2f} ms  {cnt[k]/n:6.1f}/tok  {v/cnt[k]*1e6:6.1f} us each")

# second pass: per region wall and native time
from sluice.models.layers import moe as moe_mod, gated_deltanet as gd, residual as res, gated_attention as ga, norm as nm
reg = collections.Counter(); regn = collections.Counter()
def wrap(cls, meth, name):
    f = getattr(cls, meth)
    def w(*a, **k):
        n0 = sum(acc.values()); t = time.perf_counter(); r = f(*a, **k)
        reg[name] += time.perf_counter() - t; regn[name] += sum(acc.values()) - n0; return r
    setattr(cls, meth, w)
wrap(moe_mod.MoE, '__call__', 'moe')
wrap(moe_mod.MoE, '_shared', 'moe.shared')
wrap(moe_mod.Experts, '__call__', 'moe.experts')
wrap(gd.GatedDeltaNet, '__call__', 'deltanet')
wrap(ga.GatedAttention, '__call__', 'attention')
wrap(res.PreNorm, '_add', 'residual add')
wrap(res.PreNorm, '__call__', 'layer')
for c in [getattr(nm, x) for x in dir(nm) if isinstance(getattr(nm, x), type) and hasattr(getattr(nm, x), '__call__')]:
    if c.__module__ == nm.__name__: wrap(c, '__call__', 'norm')
wall = run(N + 8)
print(f"{mode}: {wall/n*1e3:.1f} ms/token with regions")
for k, v in reg.most_common(): print(f"  {k:16s} wall {v/n*1e3:6.2f} ms  native {regn[k]/n*1e3:6.2f}  other {(v-regn[k])/n*1e3:6.2f}")
if mode != 'resident':
    from sluice.store import streaming as sst
    wrap(sst.StreamingExpertStore, 'acquire', 'store.acquire')
    wrap(sst.StreamingExpertStore, '_wait', 'store._wait')
    wrap(sst.StreamingExpertStore, 'release', 'store.release')
    wall = run(N + 8)
    print(f"{mode}: {wall/n*1e3:.1f} ms/token with store regions")
    for k, v in reg.most_common(): print(f"  {k:16s} wall {v/n*1e3:6.2f} ms  native {regn[k]/n*1e3:6.2f}  other {(v-regn[k])/n*1e3:6.2f}")
