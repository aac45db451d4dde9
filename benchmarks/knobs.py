"""Decode-side, I/O and cache choices, each measured against its alternatives (the prompt's: prefill/knobs.py).

    .venv/bin/python benchmarks/knobs.py arms        [--model GGUF] [--rounds 4] [--tokens 64]
    .venv/bin/python benchmarks/knobs.py threads     [--model GGUF] [--rounds 4]
    .venv/bin/python benchmarks/knobs.py layouts     [--rounds 3] [--experts 64]
    .venv/bin/python benchmarks/knobs.py prefetch    [--model GGUF] [--rounds 5] [--tokens 48] [--distances 0,1024,...]
    .venv/bin/python benchmarks/knobs.py omp-wait    [--model GGUF] [--prompt 32] [--rounds 3]
    .venv/bin/python benchmarks/knobs.py split | head
    .venv/bin/python benchmarks/knobs.py projections [--model GGUF]
    .venv/bin/python benchmarks/knobs.py workers     [--size-gib 1.5] [--dir /var/tmp] [--rounds 3]
    .venv/bin/python benchmarks/knobs.py victim
    .venv/bin/python benchmarks/knobs.py deltanet    [--rounds 5] [--threads 1] [--dir /var/tmp] [--isa auto] [--tiny]

GGUF: default the peers model's Q4_K_M file (benchmarks/quantized/run.sh makes it). In-process arms alternate in
rotated order per round (benchmarks/common.py alternate, median_ms); the switches they flip go through
common.with_kernels.

arms: resident decode in three arms: the default (`--activations int16`, native decode attention and router), the
same model with the torch attention steps, and `--activations int8` (llama.cpp's one-plane activation coding): each
round's decode ms/token (median of the replay's steps), the medians, and each arm's teacher-forced decode logits
against a float32 run of the same file (relative L2, greedy agreement), so a speed-up is quoted with what it costs.
threads: resident decode with a layer's experts split over the native threads and torch on one thread for the step
(the default), against every expert on the calling thread and torch on its own threads (split_experts off); median
ms/token of each replay of 48 teacher-forced tokens after a 32-token prompt. (Was quantized/decode_threads.py.)
layouts: a decode token's 128 experts (16 layers x top-8 of 64, the peers shape: H 1024, I 512, random valid blocks,
Q4_K gate / up and a Q4_K or Q6_K down) through ExpertCall.many, the K-quants reading x in super-blocks of 256 (q8.c)
against the 32-value layout, on 1 and 2 native threads: ms per token, median of 20, per round.
prefetch: resident decode with the integer path's software prefetch at several distances (q8.c pf_bytes; 0 = off),
for both activation codings: decode ms/token per round, then the medians. The output bits do not depend on the
prefetch (checked on one decode step of each arm).
omp-wait: torch's OpenMP wait policy against sluice's native pool: resident prefill of a prompt (default 32 tokens)
and the 18 decode steps after it, each arm a fresh process (libgomp reads its policy once, at load). `sluice
default` is what importing sluice sets (OMP_WAIT_POLICY=PASSIVE with GOMP_SPINCOUNT=1000: a worker spins ~10 us
after each parallel op, then sleeps); `spin 30 us` (GOMP_SPINCOUNT=3000); `passive` sleeps at once (the default
before); `libgomp default` is the policy of an unset environment (spin 300,000 rounds, ~3 ms). Per run and arm:
prefill ms (median of 3 replays), decode ms/token mean and median (of the last replay).
split / head / projections: single QuantLinear calls (quant/linear.py, on the Compute a default load has here:
common.default_compute) against their bf16 F.linear, medians, 2 torch threads. split: Q4_K [N x 1024] at T=1, the
C pool on one thread vs its rows split over two (native/pool.py set_threads). head: a Q6_K head of a 151,936-token
vocabulary (random valid blocks) at T=1 and T=64. projections: the GGUF's head and layer-0 q/k/v at T=1 (one thread,
split) and at T=33 (many rows: the blocked float32 path, or the bf16 GEMM where the CPU has bf16 dot products).
(arms, layouts, prefetch, omp-wait, split / head / projections were quantized/decode_arms.py, kernel_layouts.py,
prefetch_arms.py, omp_wait.py, resident_ops.py.)
workers: read throughput per reader and worker count on a cold file (sluice.io.direct.DEFAULT_WORKERS). Writes a
random file (deleted at the end), then per arm and round: evicts the file (verified cold by mincore) and replays the
same batches. experts: batches of 8 "experts" of 3 x 768 KiB + 3 x 48 KiB ranges at random unaligned offsets (~19.7
MB a batch, one Qwen3-30B-A3B 4-bit layer's misses); rows: batches of 256 random 4000 B unaligned ranges (embedding
rows). Medians over rounds: MB/s, ms per batch, read amplification (/proc/self/io read_bytes / bytes asked).
(Was benchmarks/io_workers.py.)
victim: cost of one eviction choice of the streaming store's default policy (store/policy.py FairShareLFU.victim)
with the 6 GiB benchmark model's cache (31 MoE layers, 64 experts, ~600 slots, every layer at its share): the layer
asking holds its share, and a layer under its share with none above theirs (it takes the globally least recent one,
which once walked every slot). (Was benchmarks/policy_victim.py.)
deltanet: a Gated DeltaNet layer's decode token native (native/deltanet.py) against the torch steps, on a synthetic
qwen3_5_moe written to --dir (deleted after) with Qwen3.6-35B-A3B's layer shapes (hidden 2048, linear attention 16 key
/ 32 value heads of 128, attention 16 heads of 256 with 2 kv heads) and few of its layers and experts (4 layers, 3
linear : 1 full; 16 experts top-8 of 512, a shared expert), bf16, resident: one layer's conv-to-norm steps (random
projections; ms per call, median of 50, per round), then the whole decode step (ms/token, median of a replay of 32
tokens after a 16-token prompt, per round), and how far the native decode logits are from the torch steps'. --isa
caps the native kernel as LoadOptions.isa does (auto: AVX-512 where the CPU has it; avx2: what an AVX2-only CPU
runs); --tiny: a 128-wide model of the same design instead (a check that the script runs, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import sluice  # noqa: E402  before torch: it sets torch's OpenMP wait policy
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from benchmarks.common import (PEERS_Q4, alternate, child_json, decode_logits, default_compute,  # noqa: E402
                               median_ms, with_kernels)


def say(r: int, arm, ms: float) -> None:
    print(f"round {r} {arm}: {ms:.1f} ms", flush=True)


def arms(a) -> None:
    prompt = [100, 101, 102, 103]
    tokens = torch.randint(200, 20000, (a.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    with sluice.load(a.model, memory="all", dtype="float32") as m:
        exact = decode_logits(m, prompt, tokens)
    m16 = sluice.load(a.model, memory="all", threads=2, activations="int16")
    m8 = sluice.load(a.model, memory="all", threads=2, activations="int8")
    setups = {"int16": (m16, True), "int16, torch attention": (m16, False), "int8": (m8, True)}
    quality = {}
    for name, (m, native_decode) in setups.items():
        with with_kernels(m, native_decode=native_decode):
            got = decode_logits(m, prompt, tokens)
            quality[name] = (((got - exact).norm() / exact.norm()).item(),
                             (got.argmax(-1) == exact.argmax(-1)).float().mean().item())
            m.replay(prompt, tokens[:4])  # warm-up

    def run(name: str):
        m, native_decode = setups[name]

        def one() -> float:
            with with_kernels(m, native_decode=native_decode):
                m.replay(prompt, tokens)
            return 1000 * statistics.median(m.step_times.decode_s)
        return one

    times = alternate({name: run(name) for name in setups}, a.rounds, say)
    for name, v in times.items():
        rel, agree = quality[name]
        print(f"{name}: median {statistics.median(v):.1f} ms/token; decode logits vs float32: relative L2 "
              f"{rel:.2e}, greedy agreement {agree:.0%}")
    m16.close()
    m8.close()


def threads(a) -> None:
    prompt, tokens = list(range(100, 132)), list(range(200, 248))
    with sluice.load(a.model, memory="all", threads=2) as m:
        m.replay(prompt, tokens[:4])  # warm-up

        def run(split: bool):
            def one() -> float:
                with with_kernels(m, split_experts=split):
                    m.replay(prompt, tokens)
                return 1000 * statistics.median(m.step_times.decode_s)
            return one

        res = alternate({"split experts, torch 1 thread": run(True), "one thread experts, torch 2": run(False)},
                        a.rounds)
        for name, v in res.items():
            print(f"{name:32s} {[round(x, 1) for x in v]} median {statistics.median(v):.1f} ms/token")


def layouts(a) -> None:
    from sluice.quant import native
    from sluice.quant.spec import QuantSpec
    from sluice.store.layout import ExpertFormat
    from tests.quant.samples import random_expert_slots

    H, I = 1024, 512
    for down in ("Q4_K", "Q6_K"):
        fmt = ExpertFormat.of(QuantSpec.ggml("Q4_K", I, H), QuantSpec.ggml("Q4_K", I, H), QuantSpec.ggml(down, H, I))
        slots = random_expert_slots(fmt, a.experts)
        call = native.ExpertCall((fmt.gate, fmt.up, fmt.down), (0, fmt.up_offset, fmt.down_offset))
        x, ys = torch.randn(1, H), torch.empty(8, H)

        def token() -> None:
            for L in range(16):
                call.many(slots, [(8 * L + j) % a.experts for j in range(8)], x, ys, list(range(8)))

        def arm(super_blocks: bool):
            def one() -> float:  # a token's experts, median of 20
                with with_kernels(super_blocks=super_blocks):
                    return median_ms({"token": token}, rounds=20, warmup=0)["token"]
            return one

        for n in (1, 2):
            with with_kernels(threads=n):
                res = alternate({"super-blocks": arm(True), "32-blocks": arm(False)}, a.rounds)
            print(f"down {down}, {n} thread(s): " + ", ".join(
                f"{name} {' '.join(f'{t:.1f}' for t in v)} ms" for name, v in res.items()))


def prefetch(a) -> None:
    prompt = [100, 101, 102, 103]
    tokens = torch.randint(200, 20000, (a.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    models = {act: sluice.load(a.model, memory="all", threads=2, activations=act) for act in ("int16", "int8")}
    distances = [int(d) for d in a.distances.split(",")]
    for m in models.values():
        m.replay(prompt, tokens[:4])  # warm-up

    def arm(act: str, d: int):
        def one() -> float:
            with with_kernels(prefetch=d):
                models[act].replay(prompt, tokens)
            return 1000 * statistics.median(models[act].step_times.decode_s)
        return one

    times = alternate({(act, d): arm(act, d) for act in models for d in distances}, a.rounds,
                      lambda r, arm_, ms: say(r, f"{arm_[0]}/{arm_[1]}", ms))
    for (act, d), v in times.items():
        with with_kernels(prefetch=d):
            got = decode_logits(models[act], prompt, tokens[:1])
        with with_kernels(prefetch=distances[0]):
            same = torch.equal(got, decode_logits(models[act], prompt, tokens[:1]))
        print(f"{act}, prefetch {d} B: median {statistics.median(v):.1f} ms/token{'' if same else ' (logits differ!)'}")
    for m in models.values():
        m.close()


OMP_ARMS = {"sluice default": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"},
            "spin 30 us": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000"},
            "passive": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"},
            "libgomp default": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}}


def omp_child(model: str, n: int) -> dict:
    """In a fresh process whose environment names the policy (libgomp read it when this process imported torch)."""
    with sluice.load(model, memory="all", threads=2) as m:
        prompt = [100 + (i * 7919) % (m.spec.vocab_size - 100) for i in range(n)]
        tokens = list(range(200, 219))
        prefill = []
        for _ in range(3):
            m.replay(prompt, tokens)
            prefill.append(m.step_times.prefill_s)
        dec = m.step_times.decode_s
        return {"prefill_ms": 1000 * statistics.median(prefill), "decode_mean": 1000 * statistics.mean(dec),
                "decode_median": 1000 * statistics.median(dec)}


def omp_wait(a) -> None:
    def arm(name: str):
        def one() -> dict:
            cmd = [sys.executable, __file__, "omp-wait", "--model", str(a.model), "--prompt", str(a.prompt), "--child"]
            return child_json(cmd, env={**os.environ, **OMP_ARMS[name]})
        return one

    res = alternate({name: arm(name) for name in OMP_ARMS}, a.rounds, lambda r, name, row: print(
        f"round {r} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True))
    for name, rows in res.items():
        print(f"{name}: " + ", ".join(f"{k} {statistics.median(row[k] for row in rows):.1f}" for k in rows[0]))


def split_ms(q, x: torch.Tensor, n: int) -> tuple[float, float]:
    """(one thread, split over set_threads(2)) ms of q.linear(x), medians of n calls after one."""
    out = []
    for n_threads in (1, 2):
        with with_kernels(threads=n_threads):
            out.append(median_ms({"q": lambda: q.linear(x)}, rounds=n)["q"])
    return out[0], out[1]


def ms_of(f, n: int) -> float:
    """Median ms of n calls of f after one."""
    return median_ms({"f": f}, rounds=n)["f"]


def projections(a) -> None:
    from sluice.io.tensor import read_bytes
    from sluice.plan import open_index
    from sluice.quant.linear import QuantLinear, quant_spec
    from sluice.quant.tensor import read_tensor

    index = open_index(a.model)
    compute = default_compute()
    for name in ("lm_head.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.0.self_attn.v_proj.weight"):
        ref = index[name]
        wb = read_tensor(ref, torch.bfloat16)
        q = QuantLinear(quant_spec(ref, torch.bfloat16), read_bytes(ref), compute)  # rows as stored: timing
        x, x33 = torch.randn(1, ref.shape[1]).bfloat16(), torch.randn(33, ref.shape[1]).bfloat16()
        one, two = split_ms(q, x, 41)
        print(f"{name} {ref.dtype} {list(ref.shape)}: T=1 bf16 {ms_of(lambda: F.linear(x, wb), 41):.3f} ms, "
              f"QuantLinear {one:.3f}, split {two:.3f} | T=33 bf16 {ms_of(lambda: F.linear(x33, wb), 11):.2f}, "
              f"blocked float32 {ms_of(lambda: q.linear(x33), 11):.2f}")


def split(a) -> None:
    from sluice.quant.linear import QuantLinear
    from sluice.quant.spec import QuantSpec
    from tests.quant.samples import random_stored

    compute = default_compute()
    for rows in (1024, 2048, 4096, 8192):
        spec = QuantSpec.ggml("Q4_K", rows, 1024)
        one, two = split_ms(QuantLinear(spec, random_stored(spec), compute), torch.randn(1, 1024).bfloat16(), 101)
        print(f"Q4_K [{rows} x 1024] T=1: one thread {one:.3f} ms, split {two:.3f} ms")


def head(a) -> None:
    from sluice.quant.linear import QuantLinear
    from sluice.quant.spec import QuantSpec
    from tests.quant.samples import random_stored

    spec = QuantSpec.ggml("Q6_K", 151936, 1024)
    q = QuantLinear(spec, random_stored(spec), default_compute())
    wb = q.dequantize().bfloat16()
    x, x64 = torch.randn(1, 1024).bfloat16(), torch.randn(64, 1024).bfloat16()
    one, two = split_ms(q, x, 21)
    print(f"Q6_K [151936 x 1024]: T=1 bf16 F.linear {ms_of(lambda: F.linear(x, wb), 21):.1f} ms, QuantLinear "
          f"{one:.1f}, split {two:.1f}; T=64 bf16 {ms_of(lambda: F.linear(x64, wb), 5):.0f}, blocked float32 "
          f"{ms_of(lambda: q.linear(x64), 5):.0f}")


def workers(a) -> None:
    import functools

    import numpy as np

    from sluice.io import DirectReader, MmapReader, ReadRange, WillneedReader
    from sluice.io.residency import evict, verify_cold

    def io_read_bytes() -> int:
        for line in open("/proc/self/io"):
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
        return 0

    def make_file(path: str, size: int) -> None:
        rng = np.random.default_rng(0)
        with open(path, "wb") as f:
            left = size
            while left:
                n = min(64 << 20, left)
                f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
                left -= n

    def expert_batches(path: str, size: int, n: int, seed: int) -> list:
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(n):
            reqs = []
            for _e in range(8):
                for nbytes in (768 << 10,) * 3 + (48 << 10,) * 3:
                    off = int(rng.integers(0, size - nbytes))
                    reqs.append((ReadRange(path, off, nbytes), torch.empty(nbytes, dtype=torch.uint8)))
            out.append(reqs)
        return out

    def row_batches(path: str, size: int, n: int, seed: int) -> list:
        rng = np.random.default_rng(seed + 1000)
        return [[(ReadRange(path, int(rng.integers(0, size - 4000)), 4000), torch.empty(4000, dtype=torch.uint8))
                 for _ in range(256)] for _ in range(n)]

    def run_arm(make, path: str, batches) -> tuple[float, float, float]:
        """(MB/s, median ms per batch, amplification) for one cold pass over `batches`."""
        evict(path)
        verify_cold([path])
        reader = make()
        asked = sum(r.nbytes for b in batches for r, _ in b)
        io0 = io_read_bytes()
        times = []
        t0 = time.perf_counter()
        for b in batches:
            t = time.perf_counter()
            reader.read(b)
            times.append(time.perf_counter() - t)
        wall = time.perf_counter() - t0
        amp = (io_read_bytes() - io0) / asked
        reader.close()
        return asked / wall / 1e6, statistics.median(times) * 1e3, amp

    size = int(a.size_gib * (1 << 30))
    path = os.path.join(a.dir, f"sluice_io_workers_{os.getpid()}.bin")
    readers = {"mmap": MmapReader, "willneed": WillneedReader}
    for odirect in (False, True):
        for w in (1, 2, 4, 8, 16):
            readers[f"direct w={w}{' odirect' if odirect else ''}"] = lambda w=w, o=odirect: DirectReader(w, o)

    @functools.lru_cache(maxsize=1)
    def batches(rnd: int) -> tuple[list, list]:  # the same batches for every reader of a round, new ones each round
        return (expert_batches(path, size, a.expert_batches, rnd), row_batches(path, size, a.row_batches, rnd))

    def arm(name: str):
        done = [0]  # each arm runs once per round: its n-th run is round n

        def one() -> tuple:
            eb, rb = batches(done[0])
            done[0] += 1
            return run_arm(readers[name], path, eb) + run_arm(readers[name], path, rb)
        return one

    try:
        make_file(path, size)
        results = alternate({name: arm(name) for name in readers}, a.rounds,
                            lambda r, name, res: print(f"round {r} {name}: {res}", file=sys.stderr))
        print(f"cold file {size / 2**30:.1f} GiB in {a.dir}, {a.rounds} rounds, medians")
        print("| arm | experts MB/s | ms/batch (19.7 MB) | amp | rows MB/s | ms/batch (256 x 4000 B) | amp |")
        print("|---|---|---|---|---|---|---|")
        for name in readers:
            cols = [statistics.median(r[i] for r in results[name]) for i in range(6)]
            print(f"| {name} | {cols[0]:.0f} | {cols[1]:.1f} | {cols[2]:.2f} | {cols[3]:.1f} | {cols[4]:.1f} "
                  f"| {cols[5]:.2f} |")
    finally:
        if os.path.exists(path):
            os.unlink(path)


def victim(a) -> None:
    from sluice.store.policy import FairShareLFU

    layers = list(range(31))
    p = FairShareLFU(layers, num_experts=64, top_k=8, slots=600)
    for L in layers:
        for e in range(p.quota):
            p.insert((L, e), L * 64 + e)
    usable = lambda key, slot: True  # noqa: E731
    full = median_ms({"full": lambda: p.victim(0, usable)}, rounds=5, reps=1000)["full"]
    p.remove((5, 0))
    under = median_ms({"under": lambda: p.victim(5, usable)}, rounds=5, reps=1000)["under"]
    print(f"{len(p)} slots, share {p.quota}: own share full {1000 * full:.1f} us per victim, under its share "
          f"{1000 * under:.1f} us")


def deltanet(a) -> None:
    import tempfile

    from sluice.tools.synth import SynthConfig, make_model

    shape = (dict(hidden_size=128, num_heads=2, num_kv_heads=1, head_dim=64, num_experts=4, top_k=2,
                  moe_intermediate_size=64, vocab_size=512) if a.tiny else
             dict(hidden_size=2048, num_heads=16, num_kv_heads=2, head_dim=256, num_experts=16, top_k=8,
                  moe_intermediate_size=512, vocab_size=8192))
    sc = SynthConfig(arch="qwen3_5_moe", num_layers=4, **shape)
    prompt, tokens = list(range(100, 116)), list(range(200, 232))
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp, with_kernels(threads=a.threads):
        with sluice.load(make_model(Path(tmp) / "m", sc, progress=False), memory="all", threads=a.threads,
                         isa=a.isa) as m:
            if m.model.build.deltanet_decode is None:
                raise SystemExit("deltanet: the native Gated DeltaNet step does not run here (native.available() "
                                 "False: pip install -e . with a C compiler builds it)")
            isa = m.model.build.deltanet_decode.isa
            mixer = next(layer.mixer for layer in m.model.layers if hasattr(layer.mixer, "native"))
            d, g = mixer.d, torch.Generator().manual_seed(0)
            proj = [torch.randn(1, n, generator=g).bfloat16() for n in (d.conv_dim, d.value_dim, d.n_v_heads,
                                                                         d.n_v_heads)]
            calls = {"native": lambda: mixer.native(*proj), "torch": lambda: mixer._steps(*proj)}
            layer = alternate({k: (lambda f=f: median_ms({"f": f}, rounds=50)["f"]) for k, f in calls.items()},
                              a.rounds, lambda r, k, ms: print(f"round {r} one layer, {k}: {ms:.3f} ms", flush=True))

            def step(native: bool):
                def one() -> float:
                    with with_kernels(m, native_deltanet=native):
                        m.replay(prompt, tokens)
                    return 1000 * statistics.median(m.step_times.decode_s)
                return one

            whole = alternate({"native": step(True), "torch": step(False)}, a.rounds, say)
            logits = {}
            for native in (True, False):
                with with_kernels(m, native_deltanet=native):
                    logits[native] = decode_logits(m, prompt, tokens)
    print(f"{a.threads} thread(s), bf16, resident, native kernel {isa} (--isa {a.isa}), medians over {a.rounds} "
          f"rounds{' (--tiny: not a measurement)' if a.tiny else ''}")
    for k in calls:
        print(f"{k}: one layer's conv-to-norm {statistics.median(layer[k]):.3f} ms; whole decode step "
              f"{statistics.median(whole[k]):.1f} ms/token")
    diff = ((logits[True] - logits[False]).norm() / logits[False].norm()).item()
    agree = (logits[True].argmax(-1) == logits[False].argmax(-1)).float().mean().item()
    print(f"native vs torch decode logits: relative L2 {diff:.2e}, greedy agreement {agree:.0%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)

    def add(name: str, what: str, rounds: int | None = None, model: bool = True, **more) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=what, description=what + " (the module docstring has the details)")
        if model:
            p.add_argument("--model", default=str(PEERS_Q4), help="a GGUF (default: the peers model's Q4_K_M)")
        if rounds is not None:
            p.add_argument("--rounds", type=int, default=rounds, help=f"arms alternated in each (default {rounds})")
        for flag, (kind, default, text) in more.items():
            p.add_argument("--" + flag.replace("_", "-"), type=kind, default=default,
                           help=f"{text} (default {default})")
        return p

    add("arms", "resident decode: int16, int16 with torch attention, int8", 4,
        tokens=(int, 64, "teacher-forced decode steps"))
    add("threads", "resident decode: a layer's experts split over the native threads, or not", 4)
    add("layouts", "a token's 128 experts: K-quants reading x in super-blocks of 256 or 32-value blocks", 3,
        model=False, experts=(int, 64, "distinct experts cycled through (64: 54 MB, past L3)"))
    add("prefetch", "resident decode at several prefetch distances of the integer row loop", 5,
        tokens=(int, 48, "teacher-forced decode steps"),
        distances=(str, "0,1024,2048,4096", "prefetch distances in bytes, comma-separated"))
    add("omp-wait", "torch's OpenMP wait policies, a fresh process each", 3,
        prompt=(int, 32, "prompt tokens")).add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add("split", "Q4_K [N x 1024] QuantLinear at T=1, one thread or split over two", model=False)
    add("head", "a Q6_K [151936 x 1024] head at T=1 and T=64 against bf16 F.linear", model=False)
    add("projections", "the GGUF's head and layer-0 q/k/v as QuantLinear against bf16 F.linear")
    add("workers", "read throughput per reader and worker count on a cold file", 3, model=False,
        size_gib=(float, 1.5, "size of the random file, GiB"), dir=(str, "/var/tmp", "where the file is written"),
        expert_batches=(int, 24, "batches of 8 experts' ranges"), row_batches=(int, 8, "batches of 256 rows"))
    add("victim", "us per eviction choice of the store's default policy", model=False)
    add("deltanet", "a Gated DeltaNet layer's decode token native or in torch, one layer and a whole step", 5,
        model=False, threads=(int, 1, "threads (torch's and the native pool's)"),
        dir=(str, "/var/tmp", "where the synthetic model is written"),
        isa=(str, "auto", "the native kernels' cap: auto, avx2 or portable")).add_argument(
        "--tiny", action="store_true", help="a 128-wide model of the same design: checks that the script runs")
    a = ap.parse_args()
    if a.what == "omp-wait" and a.child:
        print(json.dumps(omp_child(a.model, a.prompt)))
        return
    if a.what in ("split", "head", "projections"):
        torch.set_num_threads(2)
    {"arms": arms, "threads": threads, "layouts": layouts, "prefetch": prefetch, "omp-wait": omp_wait,
     "split": split, "head": head, "projections": projections, "workers": workers, "victim": victim,
     "deltanet": deltanet}[a.what](a)


if __name__ == "__main__":
    try:
        main()
    except sluice.errors.SluiceError as e:  # a missing or bad model file: its message, not a traceback
        sys.exit(f"knobs.py: {e}")
