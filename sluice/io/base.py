"""What every reader shares: the Reader protocol, the future submit() returns, and the stats counters."""

from __future__ import annotations

import math
import os
import resource
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from sluice.checkpoint.ref import FileStamp
from sluice.errors import CheckpointError, ModelFileWarning
from sluice.io.ranges import Dest, Read, ReadPlan, ReadRange

Request = tuple[ReadRange, Dest]


class Reader(Protocol):
    """Moves byte ranges of model files into caller-owned buffers. One interface for mmap, willneed and direct."""

    mode: str

    def read(self, requests: Sequence[Request]) -> None:
        """Fill every destination; blocks. CheckpointError (naming the file) on a missing/short/unreadable file."""
        ...

    def submit(self, requests: Sequence[Request]) -> ReadFuture:
        """Start filling the destinations; `.result()` blocks until they are filled (and raises read errors)."""
        ...

    def submit_each(self, batches: Sequence[Sequence[Request]]) -> list[ReadFuture]:
        """submit() of each batch, in order, one future each (each done when its own destinations are); a reader
        may check the files once for the whole call (the direct reader does)."""
        ...

    def expect(self, stamps: Iterable[FileStamp]) -> None:
        """Read each stamped file only as that version (the one whose header was read): CheckpointError naming
        the file if it was replaced before the reader opens it, or changes after (see FileGuard)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters since the reader was made: bytes_read, reads, coalesced, dedup_saved_bytes, wait_s, faults."""
        ...

    def close(self) -> None:
        """Release mappings, file descriptors and threads. Idempotent."""
        ...

    def journal(self, into: list | None) -> None:
        """From now on append each batch's file reads to `into` (None: stop); see Counters.journal."""
        ...


# How often `check` also looks the path up (a stat, ~4 us here against fstat's ~2): at most every this many seconds
# per file, so a streaming step's dozens of batches pay for it about once.
PATH_CHECK_S = 0.25


class FileGuard:
    """The version of each file a reader may read, and the checks that keep it to that version.

    A stamp comes from `expect` (the header's FileStamp, so a file replaced before its first read is caught) or,
    for a file nobody stamped, from the reader's own first open. `opened` checks a freshly opened descriptor;
    `check` runs before each batch touches the file: one fstat per file per batch (per call for the direct reader's
    submit_each, whose batches the streaming store sends a layer at a time), 2-11 us on the shared 2-core VM, 66 us
    in its slow state (benchmarks/results/hybrid/step_profile.txt; the per-step cost is in io/mapped.py `_copy`). A
    file that changes DURING a batch is not caught by this: see each reader's docstring.

    A file replaced by rename, or removed, after it was opened is not an error: the open descriptor keeps the
    version the header described, and every byte read is still right. But the model on disk is no longer the one
    running, so `check` also looks the path up (every PATH_CHECK_S at most) and warns once per file
    (ModelFileWarning).
    """

    def __init__(self) -> None:
        self._stamps: dict[str, FileStamp] = {}
        self._lock = threading.Lock()
        self._looked_up: dict[str, float] = {}  # path -> when `check` last looked it up (monotonic)

    def expect(self, stamps: Iterable[FileStamp]) -> None:
        """Register the versions to hold files to (a later stamp of the same path replaces an earlier one)."""
        with self._lock:
            for stamp in stamps:
                self._stamps[stamp.path] = stamp

    def opened(self, path: str, fd: int) -> None:
        """`fd` was just opened at `path`: CheckpointError naming it if it is not the expected version, else
        remember its version when none was expected."""
        st = os.fstat(fd)
        with self._lock:
            stamp = self._stamps.get(path)
            if stamp is None:
                self._stamps[path] = FileStamp.of(path, st)
                return
        stamp.compare(st)

    def stamp(self, path: str) -> FileStamp:
        """The version `path` is held to (KeyError before it is opened or expected)."""
        with self._lock:
            return self._stamps[path]

    def check(self, path: str, fd: int) -> None:
        """Before a batch reads `path` through `fd`: CheckpointError naming it if it changed since `opened`; a
        ModelFileWarning, once, if the path no longer names it."""
        stamp = self._stamps[path]
        stamp.check(fd)
        now = time.monotonic()
        if now - self._looked_up.get(path, -math.inf) < PATH_CHECK_S:
            return
        self._looked_up[path] = math.inf if (what := stamp.moved()) else now  # inf: warned, never looked up again
        if what:
            warnings.warn(f"file {path} {what} after it was opened; this run goes on reading the version it opened "
                          "(the one its header described): reload the model to use the file now at that path",
                          ModelFileWarning, stacklevel=2)


def truncated_error(fd: int, path: str, read: Read, pos: int) -> CheckpointError:
    """The error for a read of `read`'s window that hit EOF at absolute byte `pos` before filling it: names the
    first requested range the end of the file cuts (its offset and length) and the file's size now."""
    try:
        size = os.fstat(fd).st_size
    except OSError:
        size = pos
    if read.segments:
        seg = next((s for s in read.segments if read.offset + s.rel + s.nbytes > size), read.segments[-1])
        offset, nbytes = read.offset + seg.rel, seg.nbytes
    else:  # a read decoded from a planned op list (native_pool.OpReads): its window, not its ranges
        offset, nbytes = read.offset, read.nbytes
    return CheckpointError(
        f"short read: {nbytes} bytes at offset {offset} (to byte {offset + nbytes}) were requested, but the "
        f"file has {size} bytes: the file is truncated or the index points past its end",
        file=path,
    )


def thread_faults() -> tuple[int, int]:
    """(major, minor) page faults of the calling thread so far (getrusage RUSAGE_THREAD)."""
    ru = resource.getrusage(resource.RUSAGE_THREAD)
    return ru.ru_majflt, ru.ru_minflt


class Counters:
    """Thread-safe stats shared by a reader and its workers."""

    def __init__(self, mode: str):
        self.mode = mode
        self._lock = threading.Lock()
        self.batches = 0
        self.requests = 0
        self.bytes_requested = 0
        self.bytes_read = 0
        self.reads = 0
        self.coalesced = 0
        self.dedup_saved_bytes = 0
        self.wait_s = 0.0
        self.copied_bytes = 0
        self.threads: dict[str, list[int]] = {}  # thread name -> [major_faults, minor_faults]
        # When a list: one entry per batch, the file reads it issues [(path, offset, nbytes), ...] (windows after
        # dedup and coalescing, gaps included): what `sluice bench` replays to measure a run's I/O floor with the
        # run's own reads (bench/floor.py). Off (None) unless the bench asks; appending costs ~1 us per read.
        self.journal: list[list[tuple[str, int, int]]] | None = None

    def add_plan(self, plan: ReadPlan) -> None:
        self.add_counts([plan.counts], lambda _: [(r.path, r.offset, r.nbytes) for r in plan.reads])

    def add_counts(self, counts: Sequence[tuple[int, int, int, int, int, int]],
                   journal: Callable[[int], list[tuple[str, int, int]]] | None = None) -> None:
        """Batches' counters: per batch ReadPlan.counts (requests, bytes_requested, bytes_read, reads, coalesced,
        dedup_saved_bytes; io/templates.py ReadTemplate keeps them from its plan); `journal(k)`: batch k's file reads,
        asked only while a journal is kept."""
        batches = len(counts)
        sums = [sum(c) for c in zip(*counts)] if counts else [0] * 6
        with self._lock:
            if self.journal is not None and journal is not None:
                self.journal.extend(journal(k) for k in range(batches))
            self._add(batches, sums)

    def add_totals(self, batches: int, sums: Sequence[int]) -> None:
        """add_counts of `batches` batches given as their counters' sums (no journal: io/template_queue.py)."""
        with self._lock:
            self._add(batches, sums)

    def _add(self, batches: int, sums: Sequence[int]) -> None:
        """The sums into the totals (the lock held)."""
        req, asked, read, reads, coalesced, dedup = (int(v) for v in sums)
        self.batches += batches
        self.requests += req
        self.bytes_requested += asked
        self.bytes_read += read
        self.reads += reads
        self.coalesced += coalesced
        self.dedup_saved_bytes += dedup

    def add_wait(self, seconds: float) -> None:
        with self._lock:
            self.wait_s += seconds

    def add_copied(self, nbytes: int) -> None:
        """Bytes a worker copied from its staging buffer (or a primary destination) into destinations."""
        with self._lock:
            self.copied_bytes += nbytes

    def add_faults(self, major: int, minor: int) -> None:
        """Charge fault deltas to the calling thread."""
        name = threading.current_thread().name
        with self._lock:
            f = self.threads.setdefault(name, [0, 0])
            f[0] += major
            f[1] += minor

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "mode": self.mode,
                "batches": self.batches,
                "requests": self.requests,
                "bytes_requested": self.bytes_requested,  # sum of destination sizes
                "bytes_read": self.bytes_read,  # bytes pulled from files: after dedup, with gaps read through
                "reads": self.reads,  # file reads issued (windows after coalescing)
                "coalesced": self.coalesced,  # ranges that joined another read instead of their own
                "dedup_saved_bytes": self.dedup_saved_bytes,
                "wait_s": self.wait_s,  # time callers spent blocked in read() / result()
                # direct reader: bytes copied after the read (out of staging, into duplicates); the mapped
                # readers' copies are their reads and are not counted here
                "copied_bytes": self.copied_bytes,
                "major_faults": sum(f[0] for f in self.threads.values()),
                "minor_faults": sum(f[1] for f in self.threads.values()),
                "threads": {k: {"major_faults": v[0], "minor_faults": v[1]} for k, v in self.threads.items()},
            }


class ReadFuture(Future):
    """A concurrent.futures.Future whose result() charges its blocking time to the reader's `wait_s`.

    With `run`, the work is deferred: the first result() call runs it in the caller's thread (the willneed reader
    hints at submit and copies here). done() is True once the destinations are filled.
    """

    def __init__(self, counters: Counters, run: Callable[[], None] | None = None):
        super().__init__()
        self._counters = counters
        self._run = run
        self._run_lock = threading.Lock()

    def _run_deferred(self) -> None:
        if self._run is None:
            return
        with self._run_lock:
            run, self._run = self._run, None
            if run is not None:
                try:
                    run()
                except BaseException as e:  # noqa: BLE001 - handed to the caller by result()
                    self.set_exception(e)
                else:
                    self.set_result(None)

    def result(self, timeout: float | None = None) -> None:
        t0 = time.perf_counter()
        try:
            self._run_deferred()
            return super().result(timeout)
        finally:
            self._counters.add_wait(time.perf_counter() - t0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._run_deferred()
        return super().exception(timeout)


def done_future(counters: Counters, error: BaseException | None = None) -> ReadFuture:
    """A future that is already finished (synchronous submit, empty batch, or an error found before any read)."""
    fut = ReadFuture(counters)
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
    return fut
