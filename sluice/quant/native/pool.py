"""pool.c: the extension's own worker threads, which the other C files split their rows over (one job at a time; a
call made while another runs computes on its calling thread), and the scratch the prompt calls keep between calls.

    pool.set_threads(2)           # the pool's threads; engine.py applies a model's Compute.threads when it runs
    pool.threads()                # how many it has now
    pool.release_scratch()        # free the kept prompt scratch (generate.prefill, after a prompt)

The pool is a process resource like torch's threads: every model in the process shares it, and each applies its
own thread count when it runs (engine.Model), so any count gives the same bits. A worker spins 50 us after a job, then
yields until 1 ms, then sleeps (pool.c): a decode step runs several native jobs per layer back to back and a futex
wake-up costs tens of us. A prompt once waited 200 us instead; quiet, it measured equal to the 1 ms wait (peers
Q4_K_M, resident, `benchmarks/prefill/knobs.py wait`, removed: its command is in benchmarks/results/prefill/README.md
"Removed scripts"; 2,048 tokens 2,032 vs 2,034 ms, decode 9.21 vs 9.28 ms/token), so one wait serves both and nothing
changes between passes.
"""

from __future__ import annotations

import ctypes

from ._lib import LIB

if LIB is not None:
    LIB.sluice_set_threads.argtypes = [ctypes.c_int]
    LIB.sluice_set_threads.restype = None
    LIB.sluice_threads.restype = ctypes.c_int
    LIB.sluice_keep_release.argtypes = []
    LIB.sluice_keep_release.restype = None


def set_threads(threads: int) -> None:
    """Threads native calls split their rows over (1: everything on the calling thread). Any count gives the same
    bits. A prefill's experts of 5+ rows, decode's experts of one layer (ExpertCall.many), the rows of the quantized
    projections: peers Q4_K_M, resident, prompts of 32 / 256 tokens prefilled in 359 / 2234 ms over two threads
    against 448 / 2815 on the calling thread (benchmarks/quantized/prefill_rows.py,
    removed: its command is in benchmarks/results/quantized/README.md)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if LIB is not None:
        LIB.sluice_set_threads(threads)


def threads() -> int:
    """The pool's threads now (1 without the extension)."""
    return LIB.sluice_threads() if LIB is not None else 1


def release_scratch() -> None:
    """Free the scratch buffer the native prompt calls keep between calls (pool.c keep_take); the next call
    allocates it again."""
    if LIB is not None:
        LIB.sluice_keep_release()
