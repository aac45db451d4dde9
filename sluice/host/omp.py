"""Whether torch's OpenMP workers were set up before sluice could ask them not to spin (sluice/__init__.py): torch
imported first, with neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT in the environment. libgomp reads those once, when
torch loads it, and its default spins ~3 ms after each parallel op on the CPUs sluice's native threads use: the peers
Q4_K_M file's 2,048-token prompt, resident, capped at AVX2, took 6.58-6.96 s that way against 4.70-4.74 s
(benchmarks/results/quantized/breakdown/prompt-avx2-torch-first.txt, prompt-avx2-2.txt). Nothing can change it after
the fact, so a model load says so once."""

from __future__ import annotations

import logging

log = logging.getLogger("sluice")

TORCH_FIRST = False  # set by sluice/__init__.py at import
_warned = False


def warn_torch_first() -> None:
    """One warning line, at the first model load, when torch was imported before sluice with libgomp's default."""
    global _warned
    if TORCH_FIRST and not _warned:
        _warned = True
        log.warning("sluice: torch was imported before sluice, so torch's OpenMP threads spin after each parallel op "
                    "and slow sluice's native threads (a prompt ~1.4x). Import sluice before torch, or set "
                    "OMP_WAIT_POLICY=PASSIVE in the environment before Python starts.")
