"""The direct reader's workers in C (preader.c): the same reads as the Python workers of io/direct.py, with no GIL
between a batch's submission and its last byte. DirectReader uses this pool when the extension is built (setup.py)
and the Python one otherwise, or when asked (`engine="python"`); `engine="uring"` runs the same reads from one
thread through an io_uring (uring.c).

    pool = NativePool(workers, max_gap, counters)
    fut = pool.submit(plan_chunks, fds)    # a NativeFuture (ReadFuture's interface); result() waits, GIL released

Each batch is flattened to one int64 op list (`_ops`: per read fd, the file's O_DIRECT alignment (0: buffered),
offset, nbytes, overlapping, nseg; per segment rel, nbytes, ndests, the destinations' addresses); the future keeps the
plan's buffers alive until the batch is over, and builds the Python reader's errors from the C status (the read that
failed, errno or end of file). `submit_templates` takes batches planned once (io/templates.py ReadTemplate: their op
lists made by plan.c, moved to their destinations in C).
"""

from __future__ import annotations

import array
import ctypes
import importlib.util
import os
import threading
import time
from collections.abc import Sequence

import numpy as np

from sluice.errors import CheckpointError, ConfigError
from sluice.io.base import Counters, truncated_error
from sluice.io.ranges import Read, address

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int

# one wait call of result() without a timeout: long enough to cost nothing, short enough that a KeyboardInterrupt
# (delivered between calls) is seen within it
_WAIT_NS = 200_000_000


def _load() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("sluice.io._preader")
    if spec is None or spec.origin is None:
        return None
    lib = ctypes.CDLL(spec.origin, use_errno=True)
    lib.sluice_io_open.argtypes = [_int, _i64]
    lib.sluice_io_open.restype = _ptr
    lib.sluice_io_open_uring.argtypes = [_int, _i64]
    lib.sluice_io_open_uring.restype = _ptr
    lib.sluice_io_threads.argtypes = [_ptr]
    lib.sluice_io_threads.restype = _int
    lib.sluice_io_close.argtypes = [_ptr, _ptr]
    lib.sluice_io_close.restype = None
    lib.sluice_io_submit_many.argtypes = [_ptr, _ptr, _ptr, _ptr, _i64, _ptr]
    lib.sluice_io_submit_many.restype = _int
    lib.sluice_io_done.argtypes = [_ptr]
    lib.sluice_io_done.restype = _int
    lib.sluice_io_wait.argtypes = [_ptr, _i64]
    lib.sluice_io_wait.restype = _int
    lib.sluice_io_error.argtypes = [_ptr, _ptr]
    lib.sluice_io_error.restype = None
    lib.sluice_io_counters.argtypes = [_ptr, _ptr]
    lib.sluice_io_counters.restype = None
    lib.sluice_io_release.argtypes = [_ptr]
    lib.sluice_io_release.restype = None
    lib.sluice_io_plan_many.argtypes = [_ptr, _ptr]
    lib.sluice_io_plan_many.restype = _int
    lib.sluice_io_submit_templates.argtypes = [_ptr, _ptr, _i64, _ptr]
    lib.sluice_io_submit_templates.restype = _int
    return lib


LIB = _load()

ERR_OS, ERR_EOF, ERR_NOMEM, ERR_BAD = 1, 2, 3, 4


def available() -> bool:
    """Whether preader.c is built (setup.py; optional like the kernels)."""
    return LIB is not None


def uring_error() -> str | None:
    """Why this process cannot read through io_uring (uring.c), or None when it can: a ring is opened and closed
    (ENOSYS: a kernel before 5.1 or without io_uring; EPERM: a seccomp filter, as some containers have, or
    sysctl kernel.io_uring_disabled)."""
    if LIB is None:
        return "the native reader (sluice/io/preader.c, uring.c) is not built"
    h = LIB.sluice_io_open_uring(1, 1)
    if not h:
        err = ctypes.get_errno()
        return f"io_uring is refused here ({os.strerror(err)})"
    LIB.sluice_io_close(h, (_i64 * 3)())
    return None


def _ops(chunks: Sequence[Sequence[Read]], fds: dict[str, tuple[int, int]], ops: list[int],
         ends: list[int], dests: list[int] | None = None) -> dict[int, tuple[Read, int]]:
    """A batch's chunks appended to ops (preader.c's layout) and the end of each chunk's ops, relative to the
    batch's first op, to ends (and where `dests` is a list, the index in ops of each destination address);
    returns op index (in the batch) -> (its Read, its fd)."""
    at: dict[int, tuple[Read, int]] = {}
    base = len(ops)
    for chunk in chunks:
        for r in chunk:
            fd, align = fds[r.path]  # align: the file's O_DIRECT alignment, 0 when read buffered
            at[len(ops) - base] = (r, fd)
            ops += (fd, align, r.offset, r.nbytes, int(r.overlapping), len(r.segments))
            for seg in r.segments:
                ops += (seg.rel, seg.nbytes, len(seg.dests))
                if dests is not None:
                    dests += range(len(ops), len(ops) + len(seg.dests))
                ops += [address(d) for d in seg.dests]
        ends.append(len(ops) - base)
    return at


def plan_many(batches: Sequence[Sequence[tuple[str, int, int, int]]], fds: dict[str, tuple[int, int]], *,
              max_gap: int, max_read: int, parts: int, min_split: int, max_segments: int) -> list[tuple]:
    """plan_reads, split_even and _ops of each batch, in one C call (plan.c sluice_io_plan_many): `batches` of
    requests (path, offset, nbytes, dest address or offset), `fds` path -> (fd, O_DIRECT alignment) for every path
    with bytes to read. Returns per batch (ops, ends, dests: int64 arrays as _ops fills its lists, views of one
    buffer; counts: ReadPlan.counts; paths: the files read, in order). ValueError for a negative offset or length,
    as plan_reads."""
    paths = sorted({p for b in batches for p, _, n, _ in b if n})  # plan_reads sorts by path: ranks in that order
    rank = {p: i for i, p in enumerate(paths)}
    nb, nends, cap = len(batches), max(1, parts), 16
    reqs = [v for b in batches for p, o, k, d in b for v in (rank.get(p, -1), o, k, d)]
    while True:
        arg = np.array([nb, len(paths), max_gap, max_read, min_split, max_segments, parts, cap]
                       + [len(b) for b in batches] + reqs + [v for p in paths for v in fds[p]], dtype=np.int64)
        room = sum(cap * len(b) + 64 for b in batches)
        out = np.empty(9 * nb + nends * nb + 2 * room, dtype=np.int64)
        rc = LIB.sluice_io_plan_many(arg.ctypes.data, out.ctypes.data)
        if rc == -3:  # long ranges cut at max_read into more pieces than the guess: more room for each
            cap *= 4
            continue
        if rc == -1:
            bad = next((p, o, k) for b in batches for p, o, k, _ in b if o < 0 or k < 0)
            raise ValueError(f"bad range {bad}: offset and nbytes must be >= 0")
        if rc:
            raise MemoryError("the native planner could not allocate its work arrays")
        break
    heads = out[: 9 * nb].reshape(nb, 9).tolist()
    result, at = [], 9 * nb + nends * nb
    for k, b in enumerate(batches):
        no, ne, nd = heads[k][6:9]
        c = cap * len(b) + 64
        ends = out[9 * nb + nends * k : 9 * nb + nends * k + ne]
        if len(paths) == 1:  # one file: read by the batch when it has reads (the common case, cheaply)
            used = tuple(paths) if ne else ()
        else:
            used = tuple(p for p in paths if any(q == p and n for q, _, n, _ in b))
        result.append((out[at : at + no], ends, out[at + room : at + room + nd], tuple(heads[k][:6]), used))
        at += c
    return result


class OpReads:
    """op index -> (Read, fd) of a batch's op list, decoded when asked (NativeFuture's error path, the journal):
    what _ops returns, for op lists kept as arrays (io/templates.py ReadTemplate) rather than built from Reads."""

    def __init__(self, ops: Sequence[int], paths: dict[int, str]):
        self.ops, self.paths = ops, paths  # paths: fd -> path

    def __getitem__(self, i: int) -> tuple[Read, int]:
        fd, offset, nbytes = (int(v) for v in (self.ops[i], self.ops[i + 2], self.ops[i + 3]))
        return Read(self.paths[fd], offset, nbytes), fd

    def reads(self) -> list[tuple[str, int, int]]:
        """(path, offset, nbytes) of every read, in order."""
        out, i, n = [], 0, len(self.ops)
        while i < n:
            r, _ = self[i]
            out.append((r.path, r.offset, r.nbytes))
            nseg, i = int(self.ops[i + 5]), i + 6
            for _ in range(nseg):
                i += 3 + int(self.ops[i + 2])
        return out


class NativeFuture:
    """A batch in preader.c's pool: done() asks the C batch, result() waits in C (the GIL released), and the first
    look that finds it over records its outcome (the error the Python workers would raise) and frees it. Bytes
    copied and the workers' faults are the pool's counters (NativePool.counts), not each batch's: two C calls and
    two locks per batch less (~10 us of a streamed step's thread per missed expert).

    ReadFuture's interface (done, result, exception; result's blocking time charged to the reader's wait_s) without
    concurrent.futures.Future under it: its Condition and the two locks took ~8 us to make a future, one per missed
    expert, and its result() ~3 us more, on the model's thread (~2 ms of a streamed token of the issue-30 model)."""

    __slots__ = ("_counters", "_handle", "_at", "_lock", "_over", "_error")

    def __init__(self, counters: Counters, handle: int, at: dict[int, tuple[Read, int]] | OpReads,
                 keep: object = None):
        self._counters, self._handle, self._at = counters, handle, (at, keep)
        self._lock = threading.Lock()
        self._over = False
        self._error: BaseException | None = None

    def _finish(self, kind: int) -> None:
        """Record the outcome of an over batch (once): kind 0, or its error kind."""
        with self._lock:
            h = self._handle
            if h is None:
                return
            if kind:
                status = (_i64 * 4)()
                LIB.sluice_io_error(h, status)
                self._error = self._failure(*status)
            LIB.sluice_io_release(h)
            self._handle = None
            self._at = None  # the destinations are filled: nothing to keep alive
            self._over = True

    def _failure(self, kind: int, index: int, err: int, pos: int) -> BaseException:
        """The Python reader's error for the read at op `index`."""
        r, fd = self._at[0][index]
        if kind == ERR_OS:
            return CheckpointError(f"read at offset {pos} failed: {os.strerror(err)}", file=r.path)
        if kind == ERR_EOF:
            return truncated_error(fd, r.path, r, pos)
        if kind == ERR_NOMEM:
            return MemoryError(f"the native reader could not allocate its staging buffer for {r.nbytes} bytes of "
                               f"{r.path}")
        return CheckpointError(f"the native reader refused a read plan of {r.nbytes} bytes at offset {r.offset} "
                               "(more buffers than preadv takes, or a gap larger than max_gap)", file=r.path)

    def done(self) -> bool:
        if self._over:
            return True
        h = self._handle
        if h is not None and (kind := LIB.sluice_io_done(h)) >= 0:
            self._finish(kind)
        return self._over

    def _wait(self, timeout: float | None) -> None:
        """Until the batch is over (TimeoutError past `timeout` seconds)."""
        h = self._handle
        if h is None:
            if not self._over:  # another thread is finishing it: its lock is held until the outcome is set
                with self._lock:
                    pass
            return
        if timeout is None:
            while (kind := LIB.sluice_io_wait(h, _WAIT_NS)) < 0:
                pass
        elif (kind := LIB.sluice_io_wait(h, max(0, int(timeout * 1e9)))) < 0:
            raise TimeoutError(f"the read batch is not over after {timeout} s")
        self._finish(kind)

    def result(self, timeout: float | None = None) -> None:
        t0 = time.perf_counter()
        try:
            self._wait(timeout)
            if self._error is not None:
                raise self._error
        finally:
            self._counters.add_wait(time.perf_counter() - t0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        return self._error

    def __del__(self) -> None:
        h = getattr(self, "_handle", None)
        if h is not None and LIB is not None:  # dropped before anyone looked: its reads still write into the
            LIB.sluice_io_wait(h, -1)  # destinations this future keeps alive, so they land first (bounded: reads)
            LIB.sluice_io_release(h)
            self._handle = None


class IoUringRefused(ConfigError, RuntimeError):
    """--io-engine uring where this kernel or a seccomp filter refuses io_uring: an option this machine cannot run
    (the CLI's one `error:` line, exit 2, not an internal error), and a RuntimeError as the reader's other failures to
    start are."""


class NativePool:
    """preader.c's threads for one DirectReader (never shared: two readers, two pools): `workers` threads each doing
    its reads with preadv, or (uring) one thread keeping `workers` reads in flight in an io_uring (uring.c)."""

    def __init__(self, workers: int, max_gap: int, counters: Counters, uring: bool = False):
        self.counters = counters
        self.handle = (LIB.sluice_io_open_uring if uring else LIB.sluice_io_open)(workers, max_gap)
        if not self.handle:
            if uring:
                err = ctypes.get_errno()
                raise IoUringRefused(f"the io_uring reader could not start: {os.strerror(err)} (a kernel without "
                                     "io_uring, or a seccomp filter refusing it): use --io-engine native")
            raise RuntimeError(f"the native reader could not start {workers} threads")
        self.pid = os.getpid()
        self._final = (0, 0, 0)

    def submit(self, batches: Sequence[Sequence[Sequence[Read]]],
               fds: dict[str, tuple[int, int]]) -> list[NativeFuture]:
        """Batches, each a list of chunks (split_even's; each a task for one worker), queued in order by one C call
        (one lock, one wake-up: one call per batch cost ~64 us of the calling thread each, 15 ms of a 124 ms
        streamed token of the issue-30 model under cProfile)."""
        if os.getpid() != self.pid:
            raise RuntimeError("a reader's native threads do not survive fork(): open a new reader in the child")
        ops: list[int] = []
        ends: list[int] = []
        ats = [_ops(chunks, fds, ops, ends) for chunks in batches]
        n = len(batches)
        handles = (_ptr * n)()
        parts = (_i64 * n)(*map(len, batches))
        if LIB.sluice_io_submit_many(self.handle, (_i64 * len(ops))(*ops), (_i64 * len(ends))(*ends), parts, n,
                                     handles):
            raise MemoryError(f"the native reader could not allocate {n} batches")
        return [NativeFuture(self.counters, h, at, chunks) for h, at, chunks in zip(handles, ats, batches)]

    def submit_templates(self, desc: Sequence[int], ats: Sequence[object]) -> list[NativeFuture]:
        """Batches planned once (io/templates.py ReadTemplate), batch k described by desc[6k : 6k + 6]
        (ReadTemplate.desc and the base its destinations move to: sluice_io_submit_templates), `ats[k]` its op index
        -> (Read, fd) map; one C call, which copies each op list and moves it to its base."""
        if os.getpid() != self.pid:
            raise RuntimeError("a reader's native threads do not survive fork(): open a new reader in the child")
        n = len(ats)
        handles = (_ptr * n)()
        buf = array.array("q", desc)  # ~1 us for 48 values, where a ctypes array of them took ~5.6
        if LIB.sluice_io_submit_templates(self.handle, buf.buffer_info()[0], n, handles):
            raise MemoryError(f"the native reader could not allocate {n} batches")
        counters = self.counters
        return [NativeFuture(counters, h, at, None) for h, at in zip(handles, ats)]

    def counts(self) -> tuple[int, int, int]:
        """(bytes copied, major faults, minor faults) of this pool's threads so far (their totals once closed)."""
        if self.handle:
            out = (_i64 * 3)()
            LIB.sluice_io_counters(self.handle, out)
            self._final = tuple(out)
        return self._final

    def close(self) -> None:
        """Queued batches finish, then the threads stop (close() of a forked child's copy only forgets them)."""
        h, self.handle = self.handle, None
        if h and os.getpid() == self.pid:
            out = (_i64 * 3)()
            LIB.sluice_io_close(h, out)  # the counters after the last batch
            self._final = tuple(out)
