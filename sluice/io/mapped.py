"""Readers over a read-only mapping: `MmapReader` (demand faults, the llama.cpp baseline) and `WillneedReader`.

Both copy from the mapping into the destinations in the calling thread; page faults happen during that copy and
are counted per thread. Files are mapped lazily, once, and the mapping is kept until close().

Changed files. A file is read only as the version its header described (FileGuard: the stamp handed to `expect`,
else the one seen when the file was first mapped). Mapping a file that was replaced since is refused, and before a
batch copies from a file, one fstat checks that it has not been truncated, extended or rewritten since: a
CheckpointError naming the file, not a SIGBUS and not shifted bytes. A file replaced by a new one at the same path
(rename, hub re-download) after it was mapped is not a change: the mapping keeps the old inode's bytes, which are
still the ones the header described.

The residual race, stated plainly: a truncation that lands AFTER a batch's fstat and BEFORE its copy finishes
makes the kernel send SIGBUS to the copying thread, inside a memcpy, where Python cannot turn it into an
exception: the process dies ("Bus error"). The window is one batch's copy, and in the mmap arm that copy includes
its demand faults, i.e. most of a cold step. The alternatives that report EFAULT instead of SIGBUS change what the
baseline measures, so neither is used (60 random 2 MiB copies from a cold 512 MiB file on this VM's ext4 disk):
MADV_POPULATE_READ before each copy doubled the major faults under default readahead (33-34 -> 68-87) and was
5-9x slower under MADV_RANDOM (3.5-4.6 s -> 22-32 s, same fault counts); a process_vm_readv copy also changed them
(33-34 -> 79-89 major faults). The direct reader has no such window: a short pread is an error, not a signal.
Rewriting a file in place during a copy is not caught either (the bytes of that batch may mix versions; the next
batch's fstat sees the new mtime). Per-batch check cost: see FileGuard (io/base.py) and `_copy`.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from sluice.checkpoint.ref import FileStamp
from sluice.errors import CheckpointError
from sluice.io.base import Counters, FileGuard, ReadFuture, Request, done_future, thread_faults
from sluice.io.ranges import DEFAULT_MAX_GAP, DEFAULT_MAX_READ, PAGE, ReadPlan, ReadRange, page_window, plan_reads


class _Mapping:
    """One file's open descriptor (kept for the per-batch fstat), its mapping (None for an empty file, which cannot
    be mapped) and a memoryview over it. `guard.opened` vets the descriptor before anything is mapped."""

    def __init__(self, path: str, random_access: bool, guard: FileGuard):
        self.path = path
        try:
            self.file = open(path, "rb")  # noqa: SIM115 - closed in close()
        except OSError as e:
            raise CheckpointError(f"cannot map: {e.strerror or e}", file=path) from e
        try:
            guard.opened(path, self.file.fileno())
            size = os.fstat(self.file.fileno()).st_size
            self.map = mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except (OSError, ValueError) as e:
            self.file.close()
            raise CheckpointError(f"cannot map: {e}", file=path) from e
        except BaseException:
            self.file.close()
            raise
        if self.map is not None and random_access:
            # Default readahead on a fault reads up to 8 MiB here, 3.7-7x what one expert needs; the willneed
            # reader says exactly what to read, so readahead is turned off.
            self.map.madvise(mmap.MADV_RANDOM)
        self.view = memoryview(self.map) if self.map is not None else memoryview(b"")
        self.length = size

    def fileno(self) -> int:
        return self.file.fileno()

    def close(self) -> None:
        self.view.release()
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # a slice is still referenced somewhere (e.g. a traceback); GC unmaps it later
                pass
        self.file.close()


class MmapReader:
    """Copy from a read-only mapping; misses are demand faults with the kernel's default readahead.

    submit() does the copy synchronously in the caller and returns a finished future: the baseline has no
    background I/O, so its faults stay on the critical path, as they do for mmap users.
    """

    mode = "mmap"
    _random_access = False

    def __init__(self, *, max_gap: int = DEFAULT_MAX_GAP, max_read: int = DEFAULT_MAX_READ):
        self._maps: dict[str, _Mapping] = {}
        self._guard = FileGuard()
        self._lock = threading.Lock()
        self._counters = Counters(self.mode)
        self._max_gap = max_gap
        self._max_read = max_read
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("reader is closed")

    def _mapping(self, path: str) -> _Mapping:
        """The cached mapping of `path`, made on first use (refused if the file is not the expected version)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("reader is closed")
            m = self._maps.get(path)
            if m is None:
                m = self._maps[path] = _Mapping(path, self._random_access, self._guard)
            return m

    def expect(self, stamps: Iterable[FileStamp]) -> None:
        """Read each stamped file only as that version (see FileGuard)."""
        self._guard.expect(stamps)

    def _plan(self, requests: Sequence[Request]) -> ReadPlan:
        return plan_reads(requests, max_gap=self._max_gap, max_read=self._max_read)

    def _copy(self, plan: ReadPlan) -> None:
        """Copy every read of `plan` out of the mappings (faults happen here, in the calling thread).

        Before the first copy from each file: one fstat against its stamp (FileGuard.check), which turns a file
        truncated, extended or rewritten since it was mapped into a CheckpointError instead of a SIGBUS. Cost,
        measured on this shared 2-core VM: 2-3.5 us per check at a load average of ~5 (a bare os.fstat 1.5-2.3
        us), ~11 us at ~10. A streamed decode step submits one batch per missed expert (4 on the 2-layer top-2
        test model, ~50 ms/step: < 0.1%); ~112 on a 16-layer model missing ~7 experts per layer is 0.2-1.2 ms of
        a ~300 ms step (< 0.4%).
        """
        maj0, min0 = thread_faults()
        try:
            checked: set[str] = set()
            for r in plan.reads:
                m = self._mapping(r.path)
                if r.path not in checked:
                    self._guard.check(r.path, m.fileno())
                    checked.add(r.path)
                if r.end > m.length:
                    raise CheckpointError(
                        f"range at offset {r.offset} ({r.nbytes} bytes) ends past the end of the file "
                        f"({m.length} bytes): the file is truncated or the index points past its end",
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

    def submit_each(self, batches: Sequence[Sequence[Request]]) -> list[ReadFuture]:
        """submit() of each batch in turn (each copy checks its files: see `_copy`)."""
        return [self.submit(b) for b in batches]

    def stats(self) -> dict[str, Any]:
        """Counters (see Counters.snapshot) plus the number of mapped files."""
        s = self._counters.snapshot()
        s["mapped_files"] = len(self._maps)
        return s

    def journal(self, into: list | None) -> None:
        """From now on append each batch's file reads to `into` (None: stop); see Counters.journal."""
        self._counters.journal = into

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

    Each range is hinted with asynchronous reads of the whole pages covering it (start rounded down, end rounded up,
    clamped to the file). read() hints its ranges, then copies. submit() hints now and defers the copy to the first
    `.result()` call, made in the caller's thread; `.done()` stays False until then.
    """

    mode = "willneed"
    _random_access = True

    def _advise(self, ranges: Sequence[ReadRange]) -> None:
        """One madvise(MADV_WILLNEED) per page window (ranges of one file merged when their pages touch)."""
        by_path: dict[str, list[tuple[int, int]]] = {}
        for r in ranges:
            by_path.setdefault(r.path, []).append((r.offset, r.nbytes))
        for path, spans in by_path.items():
            m = self._mapping(path)
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
