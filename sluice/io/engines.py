"""Which reader runs a direct reader's reads, and how many it keeps in flight: the engines (preader.c's threads, its
io_uring, Python threads), what --io-engine auto stands for, the io_uring's depth and a row table's readers."""

from __future__ import annotations

from sluice.io import native_pool

# Who runs the reads: "native" preader.c's threads (no GIL between submission and the last byte: io/native_pool.py
# says why), "uring" preader.c's one thread keeping the reads in flight in an io_uring (uring.c says why), "python"
# threads of io/direct.py, "auto" (resolve_engine) the io_uring where this kernel allows it, else native where built.
ENGINES = ("auto", "native", "uring", "python")

#: the expert reader's reads in flight on the io_uring (--io-workers 0 there): its one thread with 8 in flight read
#: 900 random 80 KiB blocks at ~0.5 GB/s where 8 threads read ~0.8 and 16 in flight ~0.7-0.8, and a streamed decode
#: of the issue-30 model's files ran 3.4 (UD IQ2_XXS) and 6.8 ms (Q4_K_M) a token faster at 16 than at 8 (8 of 10
#: rounds each), 6.5 and 7.8 faster than the 8 threads (10 / 7 of 10), 1.85 faster than 16 threads (9 of 10)
#: (benchmarks/results/hybrid/engine_ab.py, 2-core AMD EPYC, virtio disk: results/hybrid/engine-ab.txt)
URING_DEPTH = 16


def resolve_engine(engine: str, uring: bool = True) -> str:
    """The engine "auto" stands for: "uring" where this process may open an io_uring (native_pool.uring_error),
    else "native" where preader.c is built, else "python"; any other engine as given. uring=False: native first
    (the row tables' reader, whose many tiny reads were measured on the threads only: ROW_WORKERS).

    Why the io_uring: a streamed decode of the issue-30 model's files, two models of the same file in one process,
    one per engine, their tokens alternated 16 at a time (benchmarks/results/hybrid/engine_ab.py, 2-core AMD EPYC,
    virtio disk): at 8 reads in flight each, the UD IQ2_XXS file 57.71 -> 54.01 ms a token (12 of 12 rounds
    faster), the Q4_K_M 71.80 -> 68.19 (9 of 12), system CPU ~13-14 -> ~6-8 ms a token; at 16 (URING_DEPTH) 6.5 and
    7.8 ms faster than the 8 threads; a 512-token prompt the same either way (benchmarks/results/hybrid/
    engine-ab.txt)."""
    if engine != "auto":
        return engine
    if uring and native_pool.uring_error() is None:
        return "uring"
    return "native" if native_pool.available() else "python"


# Reads in flight for a row table's direct reads (qwen4_exp's n-gram table, `--ple direct`: a pass's thousands of
# distinct ~100-300 byte rows, each its own 4 KiB read, one batch the model waits on): 16. The rows of a 2,140-token
# prompt of real text (27,248 rows of 136 B, in 2 passes) replayed cold, O_DIRECT: 2.30 s at 8 workers, 2.03 at 16,
# 1.97 at 32; 27,264 random rows 2.04 / 1.57 / 1.71 s; 20,000: 1.70 / 1.07 / 1.34 s (benchmarks/ple/row_floor.py,
# 2-core AMD EPYC VM, virtio disk; benchmarks/results/ple). The pass computes nothing while it waits, so the extra
# threads take no time from the math.
ROW_WORKERS = 16
