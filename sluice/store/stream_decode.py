"""DecodeStream: StreamingExpertStore's decode path through C (store/stream_native.py NativeStream): an acquire's
placement, its misses' reads and its hits' guessed reads looked at, and a guess's placement and reads, one C call each,
where the store's table is slots.c's and its reader queues templates (io/template_queue.py). The same choices, slots and
reads as the store's Python path (tests/store/test_stream_native.py compares them). A layer whose experts are all in
memory goes further (run_layer: its acquire, its experts, the next layer's guess and reads, its release in one call;
tests/store/test_stream_layer.py).

Used while no journal is kept and no read of the Python path is pending (a prompt's read-ahead: its reads are looked at
first, the landed ones forgotten); the Python path lands every read kept in C first (_land_stream), so each expert's
read is in one place."""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..io.base import PATH_CHECK_S
from .slot_table import NativeSlots
from .stream_native import NativeStream, StreamRefused
from .stream_native import available as stream_available


def _landed(fut) -> bool:
    """Whether a read future is over without an error (a reader's future may lack done / exception: not known)."""
    done, exception = getattr(fut, "done", None), getattr(fut, "exception", None)
    return done is not None and exception is not None and done() and exception() is None


class DecodeStream:
    """The store's methods for its C path (a mixin of StreamingExpertStore: its table, reader, templates, pending
    reads and counters)."""

    def _fast(self) -> NativeStream | None:
        """The NativeStream for this call, or None: Python's path."""
        stream = self._stream
        if stream is None:
            stream = self._stream = self._open_stream() or False
        if not stream or not stream.queue.usable():
            return None
        if self._pending:  # a prompt's read-ahead: the landed ones forgotten; any other keeps Python's path
            for key, fut in list(self._pending.items()):
                if _landed(fut):
                    del self._pending[key]
            if self._pending:
                return None
        return stream

    def _open_stream(self) -> NativeStream | None:
        """A NativeStream over this store's table and reader, every expert's reads planned first (_plan); None where
        the table is Python's, the reader has no template queue, or stream.c is not built."""
        if self._templates is None or not isinstance(self.table, NativeSlots) or not stream_available():
            return None
        make = getattr(self.reader, "template_queue", None)
        queue = make() if make is not None else None
        if queue is None:
            return None
        if len(self._templates) < len(self.layout.layers) * self.layout.spec.num_experts and not self._plan():
            self._templates = None
            return None
        s = self.layout.spec
        return NativeStream(self.table, s.n_layers, s.num_experts, self._templates, queue, self.raw.data_ptr(),
                            self.raw.stride(0))

    def _land_stream(self) -> None:
        """Before Python's path: every guessed read kept in C lands, an expert whose read failed is dropped."""
        if self._streamed:
            self._streamed = False
            for key in self._stream.land_all():
                if key in self.table:
                    self._drop(key)

    def _acquire_fast(self, stream: NativeStream, layer: int, experts: Sequence[int], inflight: dict
                      ) -> tuple[list[int], list[int]]:
        """acquire's placement and reads in C: (slots, missed); the reads to wait for put in `inflight`."""
        queue = stream.queue
        row = self.table.usage_row(layer)
        try:
            with queue.lock:  # the reader's close() waits for it
                if not queue.usable():
                    raise RuntimeError("reader is closed")
                slots, missed, evicted, handed, sums = stream.acquire(layer, experts, row)
        except StreamRefused as e:
            self._refused(stream, layer, experts, inflight, e)  # the hits' reads landed by the caller's _fail
            raise
        return self._took(stream, layer, experts, inflight, slots, missed, evicted, handed, sums)

    def _refused(self, stream: NativeStream, layer: int, experts: Sequence[int], inflight: dict,
                 e: StreamRefused) -> None:
        """An acquire in C refused: the reads it handed over adopted into `inflight` (for _fail to land), the keys
        it evicted forgotten."""
        self._adopt(stream, layer, experts, inflight, e.handed)
        if e.evicted:
            self._evicted(e.evicted, landed=True)

    def _adopt(self, stream: NativeStream, layer: int, experts: Sequence[int], inflight: dict, handed: list) -> None:
        """The batches C handed over ((position, handle) each) as the reader's futures in `inflight`."""
        for j, h in handed:
            inflight[j] = stream.queue.adopt(h, self._templates[(layer, experts[j])])

    def _took(self, stream: NativeStream, layer: int, experts: Sequence[int], inflight: dict, slots: list[int],
              missed: list[int], evicted: list, handed: list, sums: list[int]) -> tuple[list[int], list[int]]:
        """An acquire in C done: its evicted keys forgotten, its reads handed over adopted into `inflight`, the
        misses' counted and their files checked."""
        queue = stream.queue
        if evicted:
            self._evicted(evicted, landed=True)
        self._adopt(stream, layer, experts, inflight, handed)
        if missed:
            self.bytes_read += sums[1]
            queue.account(len(missed), sums)
            # the files checked as Python's path checks them before its reads (FileGuard.check), here once they are
            # queued: a file changed fails the batch (the caller's _fail lands its reads and forgets its experts)
            if (err := queue.check(stream.files.get(layer, ()))) is not None:
                raise err
        return slots, missed

    def _prefetch_fast(self, stream: NativeStream, layer: int, experts: Sequence[int]) -> bool:
        """prefetch of a decode guess in C; False (nothing done) where a file changed: Python's path then gives each
        read its error."""
        if stream.queue.check(stream.files.get(layer, ())) is not None:
            return False
        with stream.queue.lock:
            if not stream.queue.usable():
                return False
            try:
                entries, evicted, sums = stream.prefetch(layer, experts)
            except StreamRefused as e:
                self._queued(stream, layer, [], e.evicted, [])
                raise
        self._queued(stream, layer, [e for e, _ in entries], evicted, sums)
        return True

    def _queued(self, stream: NativeStream, layer: int, placed: list[int], evicted: list, sums: list[int]) -> None:
        """A guess of `layer` placed in C: the keys it evicted forgotten (their reads landed there), the reads of the
        experts `placed` counted (`sums`: their plans' counters) and scored."""
        if evicted:
            self._evicted(evicted, landed=True)
        if placed:
            self._streamed = True
            self.bytes_read += sums[1]
            stream.queue.account(len(placed), sums)
            self.prefetching.placed([(layer, e) for e in placed])

    def fusable(self, layer: int):
        """`layer`'s slot stack (raw, as ExpertBatch.raw) where run_layer can take its decode step now, else None."""
        if not self.overlap or self._inflight or self._allowed is not None or self._fast() is None:
            return None
        return self._at(layer)[0]  # _fast found the reader usable (run_layer looks again under its lock)

    def run_layer(self, layer: int, experts: list[int], ctx: int) -> ExpertBatch | None:
        """A decode token's acquire of `layer`'s `experts` (ascending), and where every one is in memory, their math
        (ctx: DecodeExperts.prepared, into its out) while the deferred guess is made (guess_later's) and its reads
        queued, then release: one C call (stream.c sluice_stream_layer). None: done. Else the batch
        acquire(hold=True) returns (an expert missed, or its guessed read is in flight: the caller's math goes on as
        after acquire, then issue_deferred and release). Only where fusable(layer) said so."""
        if len(experts) > self.max_batch:
            raise ValueError(f"acquire of {len(experts)} experts > {self.max_batch} slots")
        stream, tracker = self._stream, self.prefetching
        tracker.routed(layer, experts)  # before the guess is allowed, as acquire then issue_deferred do
        nxt, guess, compute, late = self._layer_guess()
        rc = self._layer_call(stream, layer, experts, ctx, nxt, guess, compute)
        in_c = rc == 0  # the guess's reads queued in the call
        if compute is not None:  # the guess made in the call (its ids, or torch.topk ranks them here), or here
            _, g, x, chosen = late
            how = stream.made()
            guess = stream.guessed(g.k) if how == 1 else chosen(g, g.probs if how == 2 else g(x))
            tracker.noted(nxt, guess)
            in_c = in_c and how == 1
            if not compute[-1]:
                guess = ()
        if guess and rc:
            self._allowed = (nxt, guess)  # not queued: issue_deferred queues it
        if rc == 2:  # a file changed (or the reader closed): nothing done, acquire's path names it
            self._batch, self._inflight = (-1, []), {}
            return self._acquire(layer, experts, True, routed=True)
        if rc == 1:  # the acquire done, an expert not in memory: the caller's math goes on as after acquire
            try:
                slots, missed = self._took(stream, layer, experts, self._inflight, *stream.acquired(len(experts)))
            except BaseException:
                self._fail()
                raise
            return self._acquired(layer, experts, slots, missed, self._inflight, True)
        self._inflight = {}
        self.hits += len(experts)
        tracker.hits(layer, experts, ())
        if guess:
            if in_c:
                self._layer_placed(stream, nxt)
            else:  # torch.topk's choice: its reads queued here (the layer is released already)
                self._prefetch(nxt, guess)
        return None

    def _layer_guess(self) -> tuple[int, list[int] | tuple, tuple | None, tuple | None]:
        """run_layer's guess: (its layer, its ids where made already, what stream.layer computes it from where not
        (guess_later's: its throttle first, which does not need the ids), guess_later's)."""
        tracker, late = self.prefetching, self._late
        if late is not None:
            self._late = None
            g = late[1]
            return late[0], (), (*g.packed(), late[2].data_ptr(), g.ids.data_ptr(), g.k, int(tracker.admit())), late
        if (deferred := tracker.take_deferred()) is not None and tracker.allow(*deferred):
            return *deferred, None, None
        return -1, (), None, None

    def _layer_call(self, stream: NativeStream, layer: int, experts: list[int], ctx: int, nxt: int, guess,
                    compute: tuple | None) -> int:
        """stream.layer under the reader's lock, the files looked up in Python first now and then (as
        FileGuard.check does): its status, 2 where a file changed or the reader closed. The acquire's errors land
        its reads and forget its experts (_fail) before they raise."""
        queue = stream.queue
        changed = False
        if time.monotonic() >= self._ticks:
            changed = queue.check(stream.files.get(layer, ())) is not None or bool(
                (guess or compute) and queue.check(stream.files.get(nxt, ())) is not None)
            self._ticks = time.monotonic() + PATH_CHECK_S
        inflight: dict[int, object] = {}
        self._batch, self._inflight = (layer, experts), inflight
        try:
            with queue.lock:
                if changed or not queue.usable():
                    stream.clear()  # no earlier call's guess read as this one's (run_layer asks made())
                    return 2
                return stream.layer(layer, experts, self.table.usage_row(layer), ctx, nxt, guess, compute)
        except StreamRefused as e:
            self._refused(stream, layer, experts, inflight, e)
            self._fail()
            raise
        except BaseException:
            self._fail()
            raise

    def _layer_placed(self, stream: NativeStream, nxt: int) -> None:
        """After run_layer's call queued a guess of layer `nxt`: its evicted keys forgotten, its reads counted."""
        try:
            placed, evicted, sums = stream.placed()
        except StreamRefused as e:
            self._queued(stream, nxt, [], e.evicted, [])
            raise
        self._queued(stream, nxt, placed, evicted, sums)
