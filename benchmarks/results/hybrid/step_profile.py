"""Where a step's time goes on the issue-30 model (benchmarks/hybrid/run.sh makes it): cProfile of sluice's main
thread (the reader threads and the native pool's are not in it; their CPU time is in the rusage line), 2 threads.

    .venv/bin/python benchmarks/results/hybrid/step_profile.py stream    # decode, --memory 640MiB --io direct --odirect
    .venv/bin/python benchmarks/results/hybrid/step_profile.py router    # stream with --prefetch router
    .venv/bin/python benchmarks/results/hybrid/step_profile.py resident  # decode, everything in memory
    .venv/bin/python benchmarks/results/hybrid/step_profile.py prompt    # one 2,048-token prompt, everything in memory

Decode: after an 8-token warm-up, 40 tokens timed (wall and process CPU per token), then 40 more under cProfile (its
own overhead inflates them). The stream arm runs without a memory ceiling: O_DIRECT sends every read to the disk.
"""

import cProfile
import os
import pstats
import resource
import sys
import time

import sluice
import torch

Q = os.environ.get("MODEL", "benchmarks/models/qwen3_5_moe-a3b-8GiB/model-Q4_K_M.gguf")  # MODEL=... another file
mode = sys.argv[1]


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


pr = cProfile.Profile()
if mode == "prompt":
    m = sluice.load(Q, memory="all", threads=2, max_context=2100)
    ids = torch.randint(3, 32000, (2048,), generator=torch.Generator().manual_seed(0)).tolist()
    m.logits(ids[:64])
    t = time.perf_counter()
    pr.enable()
    m.logits(ids)
    pr.disable()
    print(f"prompt: 2048 tokens resident in {time.perf_counter() - t:.1f} s (under cProfile)")
else:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))  # the repository root
    from benchmarks.common import decode_options

    m = sluice.load(Q, threads=2, max_context=200, **decode_options(mode))  # stream: --prefetch none
    ids, n = [5, 6], 40
    list(m.generate_tokens(ids, max_tokens=8, temperature=0.0))
    c0, t0 = cpu(), time.perf_counter()
    list(m.generate_tokens(ids, max_tokens=n, temperature=0.0))
    print(f"{mode}: {n} tokens {(time.perf_counter() - t0) * 1000 / n:.1f} ms/token wall, "
          f"CPU {1000 * (cpu() - c0) / n:.1f} ms/token")
    pr.enable()
    list(m.generate_tokens(ids, max_tokens=n, temperature=0.0))
    pr.disable()
pstats.Stats(pr).sort_stats(sys.argv[2] if len(sys.argv) > 2 else "tottime").print_stats(int(sys.argv[3]) if len(sys.argv) > 3 else 25)
