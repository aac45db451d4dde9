"""Readers over a read-only mapping: `MmapReader` (demand faults, the llama.cpp baseline) and `WillneedReader`.

Both copy from the mapping into the destinations in the calling thread; page faults happen during that copy and
are counted per thread. Files are mapped lazily, once, and the mapping is kept until close().

Changed files: a mapping shows the inode that was mapped. A file deleted or replaced (new inode at the same path)
after mapping keeps reading the old bytes. A file TRUNCATED in place is caught by an fstat before each batch
(CheckpointError); a truncation racing with the copy itself would raise SIGBUS, which no mapping reader can avoid.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence
from typing import Any

from sluice.errors import CheckpointError
from sluice.io.base import Counters, ReadFuture, Request, done_future, thread_faults
from sluice.io.ranges import DEFAULT_MAX_GAP, DEFAULT_MAX_READ, PAGE, ReadPlan, ReadRange, page_window, plan_reads


class _Mapping:
    """One file's mapping (None for an empty file, which cannot be mapped) and a memoryview over it."""

    def __init__(self, path: str, random_access: bool):
        self.path = path
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot map: {e}", file=path) from e
        if self.map is not None and random_access:
            # Default readahead on a fault reads up to 8 MiB here, 3.7-7x what one expert needs; the willneed
            # reader says exactly what to read, so readahead is turned off.
            self.map.madvise(mmap.MADV_RANDOM)
        self.view = memoryview(self.map) if self.map is not None else memoryview(b"")
        self.length = size

    def file_size(self) -> int:
        """The file's current size (fstat), which shrinks below `length` if it was truncated after mapping."""
        return self.map.size() if self.map is not None else os.stat(self.path).st_size

    def close(self) -> None:
        self.view.release()
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # a slice is still referenced somewhere (e.g. a traceback); GC unmaps it later
                pass


class MmapReader:
    """Copy from a read-only mapping; misses are demand faults with the kernel's default readahead.

    submit() does the copy synchronously in the caller and returns a finished future: the baseline has no
    background I/O, so its faults stay on the critical path, as they do for mmap users.
    """

    mode = "mmap"
    _random_access = False

    def __init__(self, *, max_gap: int = DEFAULT_MAX_GAP, max_read: int = DEFAULT_MAX_READ):
        self._maps: dict[str, _Mapping] = {}
        self._lock = threading.Lock()
        self._counters = Counters(self.mode)
        self._max_gap = max_gap
        self._max_read = max_read
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("reader is closed")

    def _mapping(self, path: str, need_end: int = 0) -> _Mapping:
        """The cached mapping of `path`, remapped if the file grew past the mapping and `need_end` needs it."""
        with self._lock:
            if self._closed:
                raise RuntimeError("reader is closed")
            m = self._maps.get(path)
            if m is None or (need_end > m.length and m.file_size() >= need_end):
                if m is not None:
                    m.close()
                m = self._maps[path] = _Mapping(path, self._random_access)
            return m

    def _plan(self, requests: Sequence[Request]) -> ReadPlan:
        return plan_reads(requests, max_gap=self._max_gap, max_read=self._max_read)

    def _copy(self, plan: ReadPlan) -> None:
        """Copy every read of `plan` out of the mappings (faults happen here, in the calling thread)."""
        maj0, min0 = thread_faults()
        try:
            checked: dict[str, int] = {}
            for r in plan.reads:
                m = self._mapping(r.path, r.end)
                if r.path not in checked:
                    checked[r.path] = min(m.length, m.file_size())  # fstat once per file per batch
                if r.end > checked[r.path]:
                    raise CheckpointError(
                        f"range at offset {r.offset} ({r.nbytes} bytes) ends past the end of the file "
                        f"({checked[r.path]} bytes): the file is truncated or the index points past its end",
                        file=r.path,
                    )
                r.scatter(m.view[r.offset : r.end])
        finally:
            maj1, min1 = thread_faults()
            self._counters.add_faults(maj1 - maj0, min1 - min0)
        self._counters.add_plan(plan)

    def read(self, requests: Sequence[Request]) -> None:
        """Fill every destination from the mappings (blocking)."""
        fut = self.submit(requests)
        fut.result()

    def submit(self, requests: Sequence[Request]) -> ReadFuture:
        """Copy now, in the caller; the returned future is already done (it carries any CheckpointError)."""
        self._check_open()
        plan = self._plan(requests)
        try:
            self._copy(plan)
        except CheckpointError as e:
            return done_future(self._counters, e)
        return done_future(self._counters)

    def hint(self, ranges: Sequence[ReadRange]) -> None:
        """No-op: the baseline relies on demand faults."""

    def stats(self) -> dict[str, Any]:
        """Counters (see Counters.snapshot) plus the number of mapped files."""
        s = self._counters.snapshot()
        s["mapped_files"] = len(self._maps)
        return s

    def close(self) -> None:
        """Unmap every file. Idempotent; read() after close raises RuntimeError."""
        with self._lock:
            self._closed = True
            maps, self._maps = self._maps, {}
        for m in maps.values():
            m.close()

    def __enter__(self) -> MmapReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def merged_page_windows(ranges: Sequence[tuple[int, int]], file_size: int) -> list[tuple[int, int]]:
    """Page windows (start, length) of (offset, nbytes) ranges of one file, sorted, touching windows merged."""
    out: list[list[int]] = []
    for offset, nbytes in sorted(ranges):
        if nbytes <= 0:
            continue
        start, length = page_window(offset, nbytes, file_size, PAGE)
        if length <= 0:
            continue
        if out and start <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], start + length - out[-1][0])
        else:
            out.append([start, length])
    return [(s, n) for s, n in out]


class WillneedReader(MmapReader):
    """The same mapping with MADV_RANDOM, plus MADV_WILLNEED over each range as soon as it is known.

    hint() starts asynchronous reads of whole pages covering each range (start rounded down, end rounded up, clamped
    to the file). read() hints its ranges, then copies. submit() hints now and defers the copy to the first
    `.result()` call, made in the caller's thread; `.done()` stays False until then.
    """

    mode = "willneed"
    _random_access = True

    def hint(self, ranges: Sequence[ReadRange]) -> None:
        """One madvise(MADV_WILLNEED) per page window (ranges of one file merged when their pages touch).

        Advisory: a missing file is ignored here and reported by the read that needs it.
        """
        try:
            self._advise(ranges)
        except CheckpointError:
            pass

    def _advise(self, ranges: Sequence[ReadRange]) -> None:
        by_path: dict[str, list[tuple[int, int]]] = {}
        for r in ranges:
            by_path.setdefault(r.path, []).append((r.offset, r.nbytes))
        for path, spans in by_path.items():
            m = self._mapping(path, max(o + n for o, n in spans))
            if m.map is None:
                continue
            for start, length in merged_page_windows(spans, m.length):
                m.map.madvise(mmap.MADV_WILLNEED, start, length)

    def _hint_plan(self, plan: ReadPlan) -> None:
        self._advise([ReadRange(r.path, r.offset, r.nbytes) for r in plan.reads])

    def submit(self, requests: Sequence[Request]) -> ReadFuture:
        """Hint now; copy on the first result() call (in that caller's thread)."""
        self._check_open()
        plan = self._plan(requests)
        try:
            self._hint_plan(plan)
        except CheckpointError as e:
            return done_future(self._counters, e)
        return ReadFuture(self._counters, run=lambda: self._copy(plan))

    def read(self, requests: Sequence[Request]) -> None:
        """Hint every range (the kernel reads them concurrently), then copy (blocking)."""
        self.submit(requests).result()
