"""DirectReader: a persistent pool of threads doing os.preadv straight into the destination buffers.

A batch is planned (sorted, deduped, coalesced: ranges.plan_reads), cut into `workers` contiguous chunks of about
equal bytes, and each worker loops over its chunk. Buffered reads are zero-copy (preadv into the destinations, gaps
into a scratch buffer); O_DIRECT reads land in place where a destination's address agrees with its file offset
modulo the file's O_DIRECT alignment (probed at open: 512 to 4096 bytes), the rest through a page-aligned
per-worker staging buffer, copied out.

Changed files: file descriptors are opened once per path (lazily, by the caller) and kept until close(). A file is
read only as the version its header described (FileGuard: the stamp handed to `expect`, else the one seen at the
first open): opening a file replaced since is refused, and before each batch one fstat per file (in the caller,
2-11 us on the shared 2-core VM; one for all the batches of a submit_each) refuses a file truncated, extended or
rewritten since. A file deleted or replaced at the same path AFTER it was opened keeps reading the opened inode (the
old bytes, still the ones the header described). A truncation during a batch gives a short read, which is a
CheckpointError naming the file, the range and the file's size (never a signal: preadv cannot fault). Rewriting a
file in place during a batch is not caught until the next call.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from sluice.checkpoint.ref import FileStamp
from sluice.errors import CheckpointError
from sluice.io import native_pool
from sluice.io.base import (Counters, FileGuard, ReadFuture, Request, done_future, thread_faults,
                            truncated_error)
from sluice.io.engines import ENGINES, resolve_engine
from sluice.io.odirect import direct_iovecs, odirect_align
from sluice.io.ranges import (DEFAULT_MAX_GAP, DEFAULT_MAX_READ, PAGE, Read, ReadRange, address, as_buffer,
                               copy_bytes, plan_reads, split_even)
from sluice.io.template_queue import TemplateQueue
from sluice.io.templates import ReadTemplate, TemplatePlanner

# Worker threads = reads in flight. Measured by `benchmarks/knobs.py workers`: 1.5 GiB random file on /dev/vda (ext4),
# evicted with posix_fadvise(DONTNEED) and verified cold by mincore before every arm, 2 CPU cores, shared machine.
# experts: batches of 8 experts x (3 x 768 KiB + 3 x 48 KiB) at random offsets (19.7 MB); rows: 256 x 4000 B.
# Medians of 3 rounds (run A) and 5 rounds (run B); amp = /proc/self/io read_bytes / bytes asked.
#   arm               experts MB/s A / B   ms/batch A / B   rows MB/s A / B   amp experts, rows
#   mmap                   149 /  223        83.6 / 64.3        4.1 / 4.5     3.27, 194 (8 MiB fault readahead)
#   willneed               654 /  746        25.9 / 26.4      101.3 / 89.0    0.88, 2.08
#   direct w=1             581 /  557        30.2 / 35.2       28.2 / 29.5    0.88, 2.08
#   direct w=2             821 /  664        23.6 / 30.6       41.3 / 26.9
#   direct w=4            1100 /  852        17.4 / 23.4       53.9 / 49.7
#   direct w=8            1072 /  924        17.8 / 22.1       75.7 / 59.8
#   direct w=16           1173 / 1052        16.8 / 17.6       59.8 / 72.6
#   direct w=1 odirect     706 /  580        28.0 / 35.1       26.4 / 28.0    1.01, 2.09
#   direct w=4 odirect     765 /  732        24.3 / 27.2       60.8 / 53.8
#   direct w=8 odirect     747 /  714        26.2 / 28.2       53.9 / 60.6
#   direct w=16 odirect    771 /  753        26.3 / 26.6       49.1 / 52.2
# 1 -> 4 workers gains ~1.5-1.9x on expert batches and 8 gains most on small rows; past 8 the differences are within
# run-to-run noise (16 won run B, lost rows in run A) and cost threads on a 2-core host. O_DIRECT plateaus at
# ~0.75 GB/s from 4 workers (its amp 1.01 vs 0.88 buffered: buffered also hits pages earlier batches cached).
DEFAULT_WORKERS = 8


def preadv_full(fd: int, bufs: list[memoryview], offset: int, path: str, read: Read) -> None:
    """preadv until every buffer is full (preadv may return short); CheckpointError on EOF or an OS error."""
    bufs = [b for b in bufs if len(b)]
    pos = offset
    i = 0
    while i < len(bufs):
        try:
            n = os.preadv(fd, bufs[i:], pos)
        except OSError as e:
            raise CheckpointError(f"read at offset {pos} failed: {e.strerror or e}", file=path) from e
        if n == 0:
            raise truncated_error(fd, path, read, pos)
        pos += n
        i = _advance(bufs, i, n)


def _advance(bufs: list[memoryview], i: int, n: int) -> int:
    """After a preadv into bufs[i:] returned n bytes: the index of the first buffer not yet full, the partly filled
    one trimmed in place to what is left of it."""
    while n and i < len(bufs):
        if n >= len(bufs[i]):
            n -= len(bufs[i])
            i += 1
        else:
            bufs[i] = bufs[i][n:]
            n = 0
    return i


class _Scratch:
    """Per-worker buffers: `gap` (bytes read through between coalesced ranges, discarded) and a page-aligned
    staging buffer (anonymous mmap) for O_DIRECT and overlapping windows, grown on demand and then reused."""

    def __init__(self, gap: int):
        self.gap = memoryview(bytearray(max(gap, 1)))
        self._map: mmap.mmap | None = None
        self._view = memoryview(b"")

    def staging(self, n: int) -> memoryview:
        if n > len(self._view):
            size = max(-(-n // PAGE) * PAGE, 2 * len(self._view))
            # old buffer: freed by refcounting once no slice of it is left
            self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._view = memoryview(self._map)
        return self._view


class _Batch:
    """One submit(): `parts` chunks in flight; the future completes when the last one finishes."""

    def __init__(self, future: ReadFuture, parts: int):
        self.future = future
        self.remaining = parts
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def fail(self, e: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = e

    def part_done(self) -> None:
        with self._lock:
            self.remaining -= 1
            if self.remaining:
                return
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(None)


class _Pool:
    """Threads, file descriptors and counters. Holds no reference to the DirectReader, so an unclosed reader can
    still be collected (a weakref.finalize then closes the pool)."""

    def __init__(self, workers: int, odirect: bool, max_gap: int, counters: Counters, native: bool = False,
                 uring: bool = False):
        """native: the reads run on preader.c's threads (self.native; uring: its io_uring thread, `workers` reads in
        flight), this object only keeps the files; else on `workers` Python threads."""
        self.odirect = odirect
        self.odirect_fallback = False
        self.max_gap = max_gap
        self.counters = counters
        self.tasks: queue.SimpleQueue[tuple[_Batch, list[Read]] | None] = queue.SimpleQueue()
        self.fds: dict[str, tuple[int, int]] = {}  # path -> (fd, its O_DIRECT alignment; 0: buffered)
        self._by_fd: tuple[int, dict[int, str]] = (0, {})  # paths_by_fd's: (len(fds) when made, the map)
        self.guard = FileGuard()
        self.lock = threading.Lock()
        self.closed = False
        self.native = native_pool.NativePool(workers, max_gap, counters, uring) if native else None
        # daemon: a worker blocked in the queue never keeps the interpreter from exiting
        self.threads = [] if native else [
            threading.Thread(target=self._work, name=f"sluice-io-{i}", daemon=True) for i in range(workers)
        ]
        for t in self.threads:
            t.start()

    def fd(self, path: str) -> tuple[int, int]:
        """The cached (fd, O_DIRECT alignment: 0 when read buffered) of `path`, opened on first use (in the caller's
        thread)."""
        with self.lock:
            if self.closed:
                raise RuntimeError("reader is closed")
            got = self.fds.get(path)
            if got is None:
                got = self._open(path)
                try:
                    self.guard.opened(path, got[0])
                except BaseException:
                    os.close(got[0])
                    raise
                self.fds[path] = got
            return got

    def check(self, paths: Iterable[str]) -> CheckpointError | None:
        """FileGuard.check of each file before a call's batches read it (one fstat each; opens it on first use): the
        error of the first one changed, or None."""
        try:
            for path in paths:
                self.guard.check(path, self.fd(path)[0])
        except CheckpointError as e:
            return e
        return None

    def paths_by_fd(self) -> dict[int, str]:
        """fd -> path of the open files (the native futures' error messages), made again only when a file opened."""
        if self._by_fd[0] != len(self.fds):
            self._by_fd = (len(self.fds), {fd: path for path, (fd, _) in self.fds.items()})
        return self._by_fd[1]

    def _open(self, path: str) -> tuple[int, int]:
        flags = os.O_RDONLY | os.O_CLOEXEC
        if self.odirect:
            try:
                fd = os.open(path, flags | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise CheckpointError(f"cannot open: {e.strerror or e}", file=path) from e
            else:
                if align := odirect_align(fd):
                    return fd, align
                os.close(fd)
            # the filesystem refuses O_DIRECT: read buffered rather than fail; stats() says so
            self.odirect_fallback = True
        try:
            fd = os.open(path, flags)
        except OSError as e:
            raise CheckpointError(f"cannot open: {e.strerror or e}", file=path) from e
        # Buffered reads: no readahead past the requested pages (the plan already says what is needed).
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd, 0

    def _work(self) -> None:
        scratch = _Scratch(self.max_gap)
        while True:
            task = self.tasks.get()
            if task is None:
                return
            batch, reads = task
            maj0, min0 = thread_faults()
            try:
                for r in reads:
                    if batch.error is not None:  # another chunk failed: the batch is lost anyway
                        break
                    self._execute(r, scratch)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller by result()
                batch.fail(e)
            finally:
                maj1, min1 = thread_faults()
                self.counters.add_faults(maj1 - maj0, min1 - min0)
                batch.part_done()

    def _execute(self, r: Read, scratch: _Scratch) -> None:
        fd, align = self.fds[r.path]
        if align:
            self._read_direct(fd, r, scratch, align)
            return
        bufs = r.iovecs(scratch.gap)
        if bufs is None:  # overlapping ranges: read the window once, then scatter
            stage = scratch.staging(r.nbytes)
            preadv_full(fd, [stage[: r.nbytes]], r.offset, r.path, r)
            r.scatter(stage)
            self.counters.add_copied(sum(seg.nbytes * len(seg.dests) for seg in r.segments))
        else:
            preadv_full(fd, bufs, r.offset, r.path, r)
            r.copy_duplicates()
            self.counters.add_copied(sum(seg.nbytes * (len(seg.dests) - 1) for seg in r.segments))

    def _read_direct(self, fd: int, r: Read, scratch: _Scratch, align: int) -> None:
        """Read the aligned window [offset down to `align`, end up to `align`) with O_DIRECT: the whole blocks of a
        destination that sits at the file's offset modulo `align` straight into it (no copy), every other byte into
        staging and then copied out."""
        start = r.offset - r.offset % align
        need = r.end - start
        window = -(-need // align) * align
        stage = scratch.staging(window)
        bufs, direct = direct_iovecs(r, start, window, stage, align)
        pos, i = start, 0
        while i < len(bufs):
            try:
                n = os.preadv(fd, bufs[i:], pos)
            except OSError as e:
                raise CheckpointError(f"read at offset {pos} failed: {e.strerror or e}", file=r.path) from e
            pos += n
            if pos - start >= need:
                break
            # EOF: 0 bytes, or a short read ending off the block grid (O_DIRECT returns short only at EOF, and the
            # next read would be misaligned)
            if n == 0 or n % align:
                raise truncated_error(fd, r.path, r, pos)
            i = _advance(bufs, i, n)
        copied = 0
        for seg, (a, b) in zip(r.segments, direct):  # the bytes outside each direct run came through staging
            src, dst = stage[seg.rel + r.offset - start :], seg.dests[0]
            for lo, hi in ((0, a), (b, seg.nbytes)):
                if hi > lo:
                    copy_bytes(dst[lo:hi], src[lo:hi])
                    copied += hi - lo
            for d in seg.dests[1:]:
                copy_bytes(d, dst)
                copied += seg.nbytes
        self.counters.add_copied(copied)

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        for _ in self.threads:
            self.tasks.put(None)  # FIFO: batches already queued finish first
        for t in self.threads:
            if t is not threading.current_thread():
                t.join()
        if self.native is not None:  # its queued batches finish before the files close
            self.native.close()
        for fd, _ in self.fds.values():
            os.close(fd)
        self.fds.clear()


class DirectReader:
    """Reads by a persistent pool of `workers` threads (started here, stopped by close()).

    read() blocks until the batch is in; submit() returns at once with a future (`.result()`, `.done()`); read
    errors (CheckpointError naming the file) are raised in the thread that calls read()/result(). After an error
    some destinations of that batch may be partly filled; the pool stays usable.
    """

    mode = "direct"

    def __init__(
        self,
        workers: int = DEFAULT_WORKERS,
        odirect: bool = False,
        *,
        max_gap: int = DEFAULT_MAX_GAP,
        max_read: int = DEFAULT_MAX_READ,
        engine: str = "auto",
    ):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        if engine in ("native", "uring") and not native_pool.available():
            raise RuntimeError("the native reader (sluice/io/preader.c) is not built: reinstall sluice with a C "
                               "compiler, or use engine='python'")
        self.engine = resolve_engine(engine)
        self.workers = workers
        self.odirect = odirect
        self._max_gap = max_gap
        self._max_read = max_read
        self._counters = Counters(self.mode)
        self._pool = _Pool(workers, odirect, max_gap, self._counters, native=self.engine != "python",
                           uring=self.engine == "uring")
        # plans batches once for submit_templates (io/templates.py), with this reader's files and read sizes
        self._planner = TemplatePlanner(self._pool.fd, max_gap, max_read, workers)
        self._finalizer = weakref.finalize(self, self._pool.close)
        self._finalizer.atexit = False  # at exit the daemon workers are simply abandoned: never wait on a read

    def submit(self, requests: Sequence[Request]) -> ReadFuture:
        """Queue the batch for the workers; the future completes when every destination is filled."""
        return self.submit_each([requests])[0]

    def submit_each(self, batches: Sequence[Sequence[Request]]) -> list[ReadFuture]:
        """Queue each batch as submit() does, in order (the workers take them first to last), one future each, so
        each completes as soon as its own destinations are filled. The files they read are checked once for all of
        them (FileGuard.check): a streamed decode step queues a layer's missed experts as one call, one fstat per
        layer where one per expert cost 16 ms of a 599 ms token (66 us each, in the slow state of the shared 2-core
        VM; benchmarks/results/hybrid/step_profile.txt). A file found changed fails every batch of the call."""
        plans = [plan_reads(b, max_gap=self._max_gap, max_read=self._max_read, parts=self.workers) for b in batches]
        if (e := self._pool.check(dict.fromkeys(path for plan in plans for path in plan.paths()))) is not None:
            return [done_future(self._counters, e) for _ in plans]  # one fstat per file per call
        futures = [ReadFuture(self._counters) for _ in plans]
        with self._pool.lock:  # close() takes this lock too: no batch can be queued behind the stop sentinels
            if self._pool.closed:
                raise RuntimeError("reader is closed")
            native: list[tuple[int, list[list[Read]]]] = []  # (future index, chunks): one C call for them all
            for i, (plan, fut) in enumerate(zip(plans, futures)):
                self._counters.add_plan(plan)
                chunks = split_even(plan.reads, self.workers)
                if not chunks:
                    fut.set_result(None)
                    continue
                if self._pool.native is not None:
                    native.append((i, chunks))
                    continue
                batch = _Batch(fut, len(chunks))
                for chunk in chunks:
                    self._pool.tasks.put((batch, chunk))
            if native:
                for (i, _), fut in zip(native, self._pool.native.submit([c for _, c in native], self._pool.fds)):
                    futures[i] = fut
        return futures

    def template(self, requests: Sequence[Request], base: int) -> ReadTemplate | None:
        """`requests` planned once for submit_templates, their destinations' addresses taken relative to `base`;
        None where the reads run on Python threads (submit_each is the way there). Opens the files."""
        if self._pool.native is None:
            return None
        offsets = []
        for rng, dest in requests:
            if rng.offset < 0 or rng.nbytes < 0:
                raise ValueError(f"bad range {rng}: offset and nbytes must be >= 0")
            buf = as_buffer(dest, rng.nbytes)  # ValueError for a destination of the wrong size, as plan_reads
            offsets.append((rng, address(buf) - base if rng.nbytes else 0))
        return self.template_at(offsets)

    def template_at(self, ranges: Sequence[tuple[ReadRange, int]]) -> ReadTemplate | None:
        """template() for destinations given as byte offsets from the base each submission moves them to: (range,
        offset) each, the caller vouching that every destination holds its range's bytes (io/templates.py)."""
        return None if self._pool.native is None else self._planner.template_at(ranges)

    def templates_at(self, batches: Sequence[Sequence[tuple[ReadRange, int]]]) -> list[ReadTemplate] | None:
        """template_at for many batches in one C call (a streaming store's layer of experts: io/templates.py);
        None where the reads run on Python threads."""
        return None if self._pool.native is None else self._planner.templates_at(batches)

    def submit_templates(self, items: Sequence[tuple[ReadTemplate, int]]) -> list[ReadFuture]:
        """submit_each for batches planned before: each (template, base) reads the template's ranges into its
        destinations moved to `base`, in order, one future each, in one C call; the files are checked once
        (FileGuard.check), as submit_each does. The caller keeps the destinations alive until each future is done."""
        # 8-23 us less a call of 8 templates than building each list per template (48-65 -> 39-50 us, in-process
        # A/B on the Intel VM: results/hybrid/submit-trim.txt): the planner shares one paths tuple among the
        # templates of a file (io/templates.py), so the files come from the distinct tuples; the counters are summed
        tuples = {t.paths for t, _ in items}
        files = next(iter(tuples)) if len(tuples) == 1 else tuple(dict.fromkeys(p for ps in tuples for p in ps))
        if (e := self._pool.check(files)) is not None:
            return [done_future(self._counters, e) for _ in items]
        every = all(len(t.ends) for t, _ in items)
        with self._pool.lock:
            if self._pool.closed:
                raise RuntimeError("reader is closed")
            paths = self._pool.paths_by_fd()
            self._counters.add_counts([t.counts for t, _ in items],
                                      lambda k: native_pool.OpReads(items[k][0].ops, paths).reads())
            live = items if every else [(t, base) for t, base in items if len(t.ends)]
            if not live:
                return [done_future(self._counters) for _ in items]
            futs = self._pool.native.submit_templates([v for t, base in live for v in (*t.desc, base)],
                                                      [native_pool.OpReads(t.ops, paths) for t, _ in live])
        if every:
            return futs
        it = iter(futs)
        return [next(it) if len(t.ends) else done_future(self._counters) for t, _ in items]

    def template_queue(self) -> TemplateQueue | None:
        """This reader's native pool for C code that queues templates itself (io/template_queue.py), None where the
        reads run on Python threads."""
        return None if self._pool.native is None else TemplateQueue(self._pool, self._counters)

    def read(self, requests: Sequence[Request]) -> None:
        """Fill every destination (blocking)."""
        self.submit(requests).result()

    def alignment(self, paths: Iterable[str]) -> int:
        """The O_DIRECT alignment that suits every one of `paths` that reads with O_DIRECT (the largest of theirs;
        opens them), 0 when none does: where a destination's address agrees with a read's file offset modulo it, the
        read lands in place (see io/odirect.py direct_iovecs)."""
        return max((self._pool.fd(p)[1] for p in dict.fromkeys(paths)), default=0)

    def expect(self, stamps: Iterable[FileStamp]) -> None:
        """Read each stamped file only as that version (see FileGuard)."""
        self._pool.guard.expect(stamps)

    def stats(self) -> dict[str, Any]:
        """Counters (see Counters.snapshot) plus workers, odirect, odirect_fallback and open_files."""
        s = self._counters.snapshot()
        if self._pool.native is not None:  # its threads count for themselves (native_pool.NativePool.counts)
            copied, major, minor = self._pool.native.counts()
            s["copied_bytes"] += copied
            s["major_faults"] += major
            s["minor_faults"] += minor
            s["threads"]["sluice-io-native"] = {"major_faults": major, "minor_faults": minor}
        s.update(
            workers=self.workers,
            engine=self.engine,
            odirect=self.odirect,
            odirect_fallback=self._pool.odirect_fallback,
            open_files=len(self._pool.fds),
        )
        return s

    def journal(self, into: list | None) -> None:
        """From now on append each batch's file reads to `into` (None: stop); see Counters.journal."""
        self._counters.journal = into

    def close(self) -> None:
        """Let queued batches finish, stop the threads, close the files. Idempotent."""
        self._finalizer()

    def __enter__(self) -> DirectReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
