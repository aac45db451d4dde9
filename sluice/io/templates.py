"""Read templates: a batch of reads planned once (io/plan.c) and submitted again and again into destinations at another
base address (DirectReader.submit_templates), as a streaming store reads a missed expert into whichever slot is free.

    planner = TemplatePlanner(fd_of, max_gap, max_read, parts)   # DirectReader makes one, with its files
    t = planner.template_at([(ReadRange(path, offset, n), dest_offset), ...])
    ts = planner.templates_at([batch, batch, ...])                 # one C call: a layer of experts
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sluice.io import native_pool
from sluice.io import ranges as ranges_mod
from sluice.io.ranges import MIN_SPLIT, ReadRange


class _Addressed:
    """An int64 array and its address, taken once (numpy's .ctypes costs ~2 us a call)."""

    __slots__ = ("array", "address")

    def __init__(self, array: np.ndarray, address: int | None = None):
        self.array, self.address = array, array.ctypes.data if address is None else address


class ReadTemplate:
    """A batch of requests planned once (io/plan.c: plan_reads, split_even, preader.c's op list), its destination
    addresses kept relative to a base address, to be submitted again and again into destinations at another base
    (DirectReader.submit_templates): a streaming store's missed expert reads the same ranges each time, only into
    another slot. Per missed expert that saves planning it, its Read objects and its op list: a streamed token of the
    issue-30 model (~235 missed experts) spent 14.9-17.4 ms of the model's thread's CPU submitting them (submit_each)
    and spends 8.4-11.0 (submit_templates), its acquires 26-30 -> 19-24 ms (2-core AMD EPYC, AVX2;
    benchmarks/results/hybrid/acquire-cpu.txt). Compact on purpose (a view of one array a layer, the rest shared
    between templates of one shape): a streaming store plans one per expert at its first miss, 597 bytes each with its
    key there (5.8 MiB for the 10,240 experts of that model; results/hybrid/template-bytes.txt), outside the memory
    budget."""

    __slots__ = ("ops", "dests", "ends", "counts", "paths", "desc")

    def __init__(self, ops: _Addressed, dests: _Addressed, ends: _Addressed,
                 counts: tuple[int, int, int, int, int, int], paths: tuple[str, ...]):
        self.ops = ops.array  # int64 [n]: the op list, destination addresses minus the base
        self.dests = dests.array  # int64 [d]: where in ops the destination addresses are
        self.ends = ends.array  # int64 [parts]: each part's end in ops (one task of the native pool each)
        self.counts = counts  # the plan's counters (ReadPlan.counts)
        self.paths = paths  # the files it reads
        # what sluice_io_submit_templates reads of it (the arrays above stay alive with it): ops, dests and their
        # count, ends and their count
        self.desc = (ops.address, dests.address, len(self.dests), ends.address, len(self.ends))


class TemplatePlanner:
    """Makes ReadTemplates for a direct reader: its files opened by `fd_of(path)` -> (fd, O_DIRECT alignment), its
    max_gap and max_read, split over `parts` workers. The parts that are the same for many templates (every expert
    of a layer has the same shape of plan) are kept once."""

    def __init__(self, fd_of: Callable[[str], tuple[int, int]], max_gap: int, max_read: int, parts: int):
        self._fd_of, self._max_gap, self._max_read, self._parts = fd_of, max_gap, max_read, parts
        self._shared: dict[Any, Any] = {}

    def _fds(self, batches: Sequence[Sequence[tuple[ReadRange, int]]]) -> dict[str, tuple[int, int]]:
        fds: dict[str, tuple[int, int]] = {}
        for ranges in batches:
            for rng, _ in ranges:
                if rng.nbytes > 0 and rng.path not in fds:
                    fds[rng.path] = self._fd_of(rng.path)
        return fds

    def _limits(self) -> dict[str, int]:
        return dict(max_gap=self._max_gap, max_read=self._max_read, parts=self._parts, min_split=MIN_SPLIT,
                    max_segments=ranges_mod.MAX_SEGMENTS)

    def template_at(self, ranges: Sequence[tuple[ReadRange, int]]) -> ReadTemplate:
        """One batch, (range, destination offset from the base) each, planned in C (plan.c: the plan plan_reads,
        split_even and _ops make, 45-51 us an expert in Python, 11.7-13.2 ms of a 101-109 ms streamed token of the
        issue-30 model where every miss is a first one: benchmarks/results/hybrid/acquire-fresh.txt); 24-26 us a
        batch alone, templates_at plans many for less (plan-layer.txt)."""
        return self.templates_at([ranges])[0]

    def templates_at(self, batches: Sequence[Sequence[tuple[ReadRange, int]]]) -> list[ReadTemplate]:
        """Many batches in one C call (a streaming store's layer of experts: 6-7 us an expert, 24-26 one call each;
        results/hybrid/plan-layer.txt); their op lists in one array."""
        plans = native_pool.plan_many([[(r.path, r.offset, r.nbytes, at) for r, at in ranges] for ranges in batches],
                                      self._fds(batches), **self._limits())
        ops = np.concatenate([p[0] for p in plans]) if plans else np.empty(0, np.int64)
        base, at, out = ops.ctypes.data, 0, []
        for plan in plans:
            n = len(plan[0])
            out.append(self._template(_Addressed(ops[at : at + n], base + 8 * at), *plan[1:]))
            at += n
        return out

    def _template(self, ops: _Addressed, ends, dests, counts, paths) -> ReadTemplate:
        shared = self._shared
        dkey, ekey = ("d", dests.tobytes()), ("e", ends.tobytes())
        if dkey not in shared:
            shared[dkey] = _Addressed(dests.copy())
        if ekey not in shared:
            shared[ekey] = _Addressed(ends.copy())
        return ReadTemplate(ops, shared[dkey], shared[ekey], shared.setdefault(counts, counts),
                            shared.setdefault(paths, paths))
