"""The I/O floor of an arm, measured in the bench run that quotes it, on the arm's own reads.

    Recorder  during an untimed replay of the arm's work (child.py `replay --journal`), every batch the model's
              readers plan (io/base.py Counters.journal: the file reads after dedup and coalescing, gaps read
              through included) is kept and cut at the end of the prefill and of each decode step: the arm's read
              plan, as (file, offset, length) ranges per step
    measure   (child.py `floor`) that plan replayed through readers made as the arm's were (io.make_reader: the same
              mode, workers and O_DIRECT or buffered), in a fresh process under the bench's memory ceiling, the
              model's files evicted and verified cold just before; the batches of one step are submitted together
              and then awaited, so they are in flight at the reader's queue depth with no compute between them

The floor of a decode step is the timed window's replay seconds / its steps; the prompt's floor is its batches'
seconds. `sluice bench` measures it before the first round and after the last (the disk's rate drifts: the same
disk gave 0.83 and 2.28 GB/s on one day), and divides step time by the faster of the two.

What the replay does not do, and which way that leans: it holds no slots, resident weights or torch runtime, so under
a ceiling it leaves the page cache more room than the arm had (a buffered re-read is likelier to hit it: a faster
floor, a larger step/floor); it reads into one scratch buffer instead of the slots (the bytes are thrown away).
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Sequence
from typing import Any

from ..host.procstat import disk_read_bytes
from ..io import DEFAULT_WORKERS, ReadRange, make_reader
from ..io.odirect import ALIGN
from ..io.residency import resident_bytes

Batch = list  # [reader index, [[file index, offset, nbytes], ...]]


def reader_spec(reader) -> dict[str, Any]:
    """What io.make_reader needs to make a reader like `reader`: its mode, and for the direct reader its workers
    and whether it asked for O_DIRECT (a filesystem that refuses O_DIRECT refuses the replay's too), and who ran
    its reads (C or Python threads)."""
    return {"mode": reader.mode, "workers": getattr(reader, "workers", DEFAULT_WORKERS),
            "odirect": bool(getattr(reader, "odirect", False)), "engine": getattr(reader, "engine", "auto")}


def model_readers(m) -> list:
    """The readers a loaded Model moves bytes with: its own, and the embedding rows' when they have their own."""
    readers = [m.reader]
    rows = getattr(m, "rows", None)
    if rows is not None and rows.reader is not None and rows.reader is not m.reader:
        readers.append(rows.reader)
    return readers


class Recorder:
    """Journals the batches of a model's readers from construction on; `mark()` after the prefill and after each
    decode step (Model.replay's on_step) cuts them into steps; `plan()` stops journaling and returns the plan."""

    def __init__(self, m):
        self._readers = model_readers(m)
        self._journals: list[list] = [[] for _ in self._readers]
        for reader, journal in zip(self._readers, self._journals):
            reader.journal(journal)
        self._cuts: list[list[int]] = []  # journal lengths at each mark

    def mark(self) -> None:
        self._cuts.append([len(j) for j in self._journals])

    def plan(self, warmup: int) -> dict[str, Any]:
        """{"readers": [spec], "files": [path], "prefill": [Batch], "steps": [[Batch]], "warmup": n}: steps holds
        the warm-up steps first, then the timed ones."""
        for reader in self._readers:
            reader.journal(None)
        files: dict[str, int] = {}
        cuts = [[0] * len(self._journals), *self._cuts]
        parts: list[list[Batch]] = []
        for a, b in zip(cuts, cuts[1:]):
            part = []
            for ri, journal in enumerate(self._journals):
                for batch in journal[a[ri]:b[ri]]:
                    if batch:
                        part.append([ri, [[files.setdefault(p, len(files)), off, n] for p, off, n in batch]])
            parts.append(part)
        return {"readers": [reader_spec(r) for r in self._readers], "files": list(files),
                "prefill": parts[0] if parts else [], "steps": parts[1:], "warmup": warmup}


def batch_bytes(batches: Sequence[Batch]) -> int:
    """Bytes the batches read from their files."""
    return sum(n for _, ranges in batches for _, _, n in ranges)


def timed_steps(plan: dict[str, Any]) -> list[list[Batch]]:
    """The plan's decode steps after its warm-up steps."""
    return plan["steps"][plan["warmup"]:]


def describe_plan(plan: dict[str, Any]) -> dict[str, Any]:
    """What results.json and the report say of a plan, beside the plan itself."""
    timed = timed_steps(plan)
    n = len(timed)
    return {
        "readers": plan["readers"],
        "files": len(plan["files"]),
        "prefill_bytes": batch_bytes(plan["prefill"]),
        "prefill_batches": len(plan["prefill"]),
        "timed_steps": n,
        "bytes_per_step": batch_bytes([b for s in timed for b in s]) / n if n else None,
        "reads_per_step": sum(len(r) for s in timed for _, r in s) / n if n else None,
        "batches_per_step": sum(len(s) for s in timed) / n if n else None,
    }


def _replay(readers: list, files: list[str], batches: Sequence[Batch], scratch: memoryview) -> float:
    """Submit every batch, then wait for all of them; seconds from the first submit to the last completion (0 for
    no batch: a step that read nothing). Each read lands in the page-aligned scratch at its file offset modulo the
    O_DIRECT block (ALIGN), as the streaming store places its slots (store/streaming.py), so O_DIRECT reads its
    whole pages straight into it with no copy out of staging, as the arm's reads do."""
    if not batches:
        return 0.0
    t0 = time.perf_counter()
    futures = [readers[ri].submit([(ReadRange(files[fi], off, n), scratch[off % ALIGN : off % ALIGN + n])
                                   for fi, off, n in ranges])
               for ri, ranges in batches]
    for f in futures:
        f.result()
    return time.perf_counter() - t0


def _resident_fraction(files: Sequence[str]) -> float:
    cached = total = 0
    for f in files:
        res, size = resident_bytes(f)
        cached, total = cached + min(res, size), total + size
    return cached / total if total else 0.0


def measure(plan: dict[str, Any], journal: list | None = None) -> dict[str, Any]:
    """Replay `plan` (see the module) and time it: the prompt's batches, then each decode step's. The caller has
    put the files in the state to measure from (the bench: evicted and verified cold). `journal`, when a list,
    receives every batch the replay's readers plan (the tests compare it with the plan)."""
    files = plan["files"]
    resident_before = _resident_fraction(files)
    readers = [make_reader(s["mode"], workers=s["workers"], odirect=s["odirect"], engine=s.get("engine", "auto"))
               for s in plan["readers"]]
    largest = max((n for part in [plan["prefill"], *plan["steps"]] for _, r in part for _, _, n in r), default=0)
    # one destination for every read: the bytes are not kept, and a 1-2 GB prompt would not fit a ceiling twice.
    # Page-aligned (an anonymous mapping), so a read at its offset modulo ALIGN goes to the disk zero-copy
    area = mmap.mmap(-1, max(largest, 1) + ALIGN)
    scratch = memoryview(area)
    try:
        for reader in readers:
            reader.journal(journal)
        io0 = disk_read_bytes()
        prefill_s = _replay(readers, files, plan["prefill"], scratch)
        io = [disk_read_bytes()]  # before each decode step, and after the last
        step_s = []
        for step in plan["steps"]:
            step_s.append(_replay(readers, files, step, scratch))
            io.append(disk_read_bytes())
        used = [{**reader_spec(r), "odirect_fallback": bool(r.stats().get("odirect_fallback"))} for r in readers]
        copied = sum(r.stats().get("copied_bytes", 0) for r in readers)
    finally:
        for reader in readers:
            reader.close()
        scratch.release()
        area.close()
    warmup = plan["warmup"]
    timed = step_s[warmup:]
    window_bytes = batch_bytes([b for s in timed_steps(plan) for b in s])
    window_s = sum(timed)
    prefill_bytes = batch_bytes(plan["prefill"])
    return {
        "ok": True,
        "resident_before": resident_before,  # mincore over the plan's files as the replay starts
        "prefill_s": prefill_s,
        "prefill_bytes": prefill_bytes,
        "prefill_disk_read_bytes": io[0] - io0,
        "step_s": step_s,  # warm-up steps first (replayed too, so the timed window starts as the arm's did)
        "warmup": warmup,
        "window_s": window_s,
        "window_bytes": window_bytes,
        "window_disk_read_bytes": io[-1] - io[min(warmup, len(step_s))],
        "floor_ms": 1000 * window_s / len(timed) if timed else None,
        "prefill_floor_ms": 1000 * prefill_s,
        "bytes_per_s": window_bytes / window_s if window_s else None,
        "readers": used,  # as made for the replay; odirect_fallback: the filesystem refused O_DIRECT
        "copied_bytes": copied,  # bytes the direct reader copied out of staging (O_DIRECT's partial pages)
    }
