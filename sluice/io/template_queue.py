"""TemplateQueue: a direct reader's native pool handed to C code that queues planned reads itself (the streaming
store's decode step, store/stream.c), with what stays the reader's: the file checks, the counters, and the futures of
the batches handed back.

    q = reader.template_queue()          # None where the reads run on Python threads
    q.pool, q.fns                        # the pool's handle; sluice_io_submit_templates, done, wait, release
    err = q.check(paths)                 # FileGuard.check of each (the error, or None)
    q.stamps(paths)                      # path -> (fd, device, inode, size, mtime ns): the versions checked
    q.account(batches, sums)             # the reader's counters: sums of the batches' ReadTemplate.counts
    fut = q.adopt(handle, template)      # a batch handed back, as submit_templates' future (NativeFuture)
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

from sluice.errors import CheckpointError
from sluice.io import native_pool
from sluice.io.templates import ReadTemplate


class TemplateQueue:
    """See the module docstring. `pool`: the reader's direct._Pool (its files, guard, lock, native pool)."""

    def __init__(self, pool, counters):
        self._pool, self._counters = pool, counters
        self._native = pool.native
        lib = native_pool.LIB
        self.fns = tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                         for name in ("sluice_io_submit_templates", "sluice_io_done", "sluice_io_wait",
                                      "sluice_io_release"))
        self.lock = pool.lock  # held around each C call that queues (close() takes it too)

    @property
    def pool(self) -> int:
        """The native pool's handle (0 once the reader is closed)."""
        return self._native.handle or 0

    def usable(self) -> bool:
        """Whether C may queue now: the reader open, no journal kept (its file reads are listed per batch, in Python:
        Counters.journal), and this process the one that started the pool's threads (they do not survive fork)."""
        return (not self._pool.closed and self._counters.journal is None and bool(self._native.handle)
                and os.getpid() == self._native.pid)

    def check(self, paths: Sequence[str]) -> CheckpointError | None:
        """FileGuard.check of each file (one fstat each), as submit_templates does before queueing: the error of the
        first one changed, or None."""
        return self._pool.check(paths)

    def stamps(self, paths: Sequence[str]) -> dict[str, tuple[int, int, int, int, int]] | None:
        """Each file's (fd, device, inode, size, mtime in ns): the version FileGuard holds it to, for C's checks of the
        same (stream.c files_same), each opened and checked here first; None where one fails its check."""
        paths = list(dict.fromkeys(paths))
        if self.check(paths) is not None:
            return None
        out = {}
        for path in paths:
            s = self._pool.guard.stamp(path)
            out[path] = (self._pool.fd(path)[0], s.dev, s.ino, s.size, s.mtime_ns)
        return out

    def account(self, batches: int, sums: Sequence[int]) -> None:
        """`batches` queued from C, their plans' counters summed (ReadTemplate.counts' order)."""
        self._counters.add_totals(batches, sums)

    def adopt(self, handle: int, template: ReadTemplate) -> native_pool.NativeFuture:
        """The future of a batch C queued from `template` and hands over (the caller's reference: released by the
        future once it is over, or when dropped, after its reads land)."""
        return native_pool.NativeFuture(self._counters, handle,
                                        native_pool.OpReads(template.ops, self._pool.paths_by_fd()), None)
