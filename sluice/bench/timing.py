"""In-process A/B timing for the scripts under benchmarks/: the arms of a comparison run in rotated order per round
(protocol.rotation, as `sluice bench` rotates its children), and a function's time is the median over rounds.

    alternate({"a": run_a, "b": run_b}, rounds=4)        # {"a": [result per round], "b": [...]}
    median_ms({"bf16": f, "float32": g}, rounds=15, reps=30)   # {"bf16": ms per call, "float32": ...}

`sluice bench` times whole processes (child.py, protocol.py); these time calls inside one process, where a
comparison alternates arms so a slow spell of a shared machine lands on all of them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

from .protocol import rotation

K = TypeVar("K", bound=Hashable)


def alternate(arms: Mapping[K, Callable[[], Any]], rounds: int,
              report: Callable[[int, K, Any], None] | None = None) -> dict[K, list[Any]]:
    """Call each arm once per round, the arms in rotation()'s order (round r starts at arm r), and collect what
    each returns, in round order. `report(round, arm, result)` after each call (progress lines)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(arms)
    out: dict[K, list[Any]] = {k: [] for k in names}
    for r in range(rounds):
        for k in rotation(names, r):
            out[k].append(arms[k]())
            if report is not None:
                report(r, k, out[k][-1])
    return out


def median_ms(fns: Mapping[K, Callable[[], Any]], rounds: int, reps: int = 1, warmup: int = 1,
              clock: Callable[[], float] = time.perf_counter) -> dict[K, float]:
    """Milliseconds per call of each function: `warmup` untimed calls of each first, then per round (alternate's
    order) `reps` calls timed together by `clock`, divided by reps; the median over rounds."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    for f in fns.values():
        for _ in range(warmup):
            f()

    def timed(f: Callable[[], Any]) -> Callable[[], float]:
        def run() -> float:
            t = clock()
            for _ in range(reps):
                f()
            return 1000 * (clock() - t) / reps
        return run

    times = alternate({k: timed(f) for k, f in fns.items()}, rounds)
    return {k: statistics.median(v) for k, v in times.items()}


def medians(results: Mapping[K, list[float]]) -> dict[K, float]:
    """The median of each arm's results (alternate's output of numbers)."""
    return {k: statistics.median(v) for k, v in results.items()}
