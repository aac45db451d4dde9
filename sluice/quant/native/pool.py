"""pool.c: the extension's own worker threads, which the other C files split their rows over (one job at a time; a
call made while another runs computes on its calling thread), and the scratch the prompt calls keep between calls.

    pool.set_threads(2)           # the pool's threads; engine.py applies a model's Compute.threads when it runs
    pool.set_wait(pool.WAIT_STREAMED_NS)  # how long a worker waits for the next job before it sleeps (engine.py)
    pool.threads()                # how many it has now
    pool.release_scratch()        # free the kept prompt scratch (generate.prefill, after a prompt)

The pool is a process resource like torch's threads: every model in the process shares it, and each applies its
own thread count when it runs (engine.Model), so any count gives the same bits. A worker spins 50 us after a job, then
yields until 1 ms, then sleeps (pool.c): a decode step runs several native jobs per layer back to back and a futex
wake-up costs tens of us. A model that streams its experts waits 100 us instead (set_wait, WAIT_STREAMED_NS). A
prompt once waited 200 us instead; quiet, it measured equal to the 1 ms wait (peers
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
    LIB.sluice_set_spin.argtypes = [ctypes.c_int64, ctypes.c_int64]
    LIB.sluice_set_spin.restype = None
    LIB.sluice_pool_wait.argtypes = []
    LIB.sluice_pool_wait.restype = ctypes.c_int64

SPIN_NS = 50_000  # a worker spins this long after a job (pool.c), then yields until its wait ends, then sleeps
#: the wait of a model that has every weight in memory: a decode step's native jobs come back to back, and a sleeping
#: worker costs the next one a futex wake-up
WAIT_RESIDENT_NS = 1_000_000
#: the wait of a model that streams its experts: a yielding worker keeps its CPU busy, so the readers' threads wake up
#: on the CPU of the model's thread and take it. Issue 30's model at --memory 640MiB, O_DIRECT, 24 tokens after 40
#: (benchmarks/results/hybrid/pool_spin.py; spin-yield.txt, 3 alternated rounds): 77.9-80.3 ms a token against
#: 83.6-93.5 with the 1 ms wait, process CPU 113-119 against 138-154 ms; resident with the 100 us wait 40.4-46.1
#: against 39.7-41.5 ms (a sleeping worker between jobs), so a resident model keeps the 1 ms.
WAIT_STREAMED_NS = 100_000


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


def set_wait(ns: int) -> None:
    """How long a worker waits for the next job before it sleeps (WAIT_RESIDENT_NS, WAIT_STREAMED_NS): like the
    thread count, the process's, applied by each model when it runs (engine.Model). Any wait gives the same bits."""
    if LIB is not None:
        LIB.sluice_set_spin(min(SPIN_NS, ns), ns)


def wait() -> int:
    """The workers' wait for the next job now, in ns (0 without the extension)."""
    return LIB.sluice_pool_wait() if LIB is not None else 0


def threads() -> int:
    """The pool's threads now (1 without the extension)."""
    return LIB.sluice_threads() if LIB is not None else 1


def release_scratch() -> None:
    """Free the scratch buffer the native prompt calls keep between calls (pool.c keep_take); the next call
    allocates it again."""
    if LIB is not None:
        LIB.sluice_keep_release()
