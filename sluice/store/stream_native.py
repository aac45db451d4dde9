"""NativeStream: a streaming store's decode-time acquire and guessed reads as one C call each (store/stream.c: the slot
table's placement, the reads queued from templates planned once, the guessed reads in flight kept in C), where the
table is slots.c's and the reader's pool is preader.c's (io/template_queue.py). StreamingExpertStore uses it for a
decode token's acquires and prefetches; its other paths (a prompt's read-ahead, a journal kept, a Python policy or
reader) stay in Python, and landing every guessed read here first (land_all) keeps the two consistent.

    st = NativeStream(table, n_layers, experts, templates, queue, raw_address, stride)
    placed, evicted, sums = st.prefetch(layer, experts)    # guessed reads queued, kept here
    slots, missed, evicted, handed, sums = st.acquire(layer, experts, usage_row)
    status = st.layer(layer, experts, usage_row, ctx, next_layer, guess)   # acquire, experts, guess's reads, release
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NoReturn

import numpy as np

from .policy import Key
from .slot_table import LIB, NO_SLOT, NativeSlots, bad_ids

_i32, _i64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p

if LIB is not None and hasattr(LIB, "sluice_stream_open"):
    for name, args, res in (
            ("sluice_stream_open", [_ptr, _i32, _i32, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64], _ptr),
            ("sluice_stream_close", [_ptr], None), ("sluice_stream_forget", [_ptr, _i32], ctypes.c_int),
            ("sluice_stream_land_all", [_ptr, _ptr], _i32), ("sluice_stream_pending", [_ptr, _i32], ctypes.c_int),
            ("sluice_stream_bind", [_ptr] * 9, None),
            ("sluice_stream_prefetch", [_ptr, _i32, _i32], _i32),
            ("sluice_stream_acquire", [_ptr, _i32, _i32, _ptr], _i32),
            ("sluice_stream_files", [_ptr, _ptr, _ptr, _i32, _ptr], None),
            ("sluice_stream_layer", [_ptr, _i32, _i32, _ptr, _ptr, _i32, _i32, _ptr, _ptr], _i32)):
        fn = getattr(LIB, name)
        fn.argtypes, fn.restype = args, res


def available() -> bool:
    """Whether stream.c is built (with slots.c, setup.py)."""
    return LIB is not None and hasattr(LIB, "sluice_stream_open")


class NativeStream:
    """Over `table` (NativeSlots) and `templates` ((layer, expert) -> ReadTemplate, every expert of every MoE layer
    planned, destinations relative to a slot's first byte), reading into slot s at raw + s * stride through `queue`
    (the reader's TemplateQueue)."""

    def __init__(self, table: NativeSlots, n_layers: int, experts: int, templates: dict, queue, raw: int,
                 stride: int):
        keys = n_layers * experts
        self.table, self.queue, self.templates, self.E = table, queue, templates, experts
        self._tmpl = np.zeros((keys, 5), dtype=np.int64)  # ReadTemplate.desc per key (0: not planned)
        self._counts = np.zeros((keys, 6), dtype=np.int64)  # ReadTemplate.counts per key
        files: dict[int, dict[str, None]] = {}
        for (layer, e), t in templates.items():
            self._tmpl[layer * experts + e] = t.desc
            self._counts[layer * experts + e] = t.counts
            files.setdefault(layer, {}).update(dict.fromkeys(t.paths))
        self.files = {layer: tuple(f) for layer, f in files.items()}  # the files a layer's experts are read from
        cap = max(table._slots, experts)  # per-call arrays, made once
        self._in, self._e, self._slot, self._ev = (np.zeros(cap, dtype=np.int32) for _ in range(4))
        self._missed = np.zeros(cap, dtype=np.uint8)
        self._handles = np.zeros(cap, dtype=np.uint64)
        self._n = np.zeros(1, dtype=np.int32)
        self._sums = np.zeros(6, dtype=np.int64)
        self._h = LIB.sluice_stream_open(table._h, n_layers, experts, self._tmpl.ctypes.data,
                                         self._counts.ctypes.data, queue.pool, *queue.fns, raw, stride)
        if not self._h:
            raise MemoryError(f"the native stream's tables for {keys} experts")
        LIB.sluice_stream_bind(self._h, *(a.ctypes.data for a in (self._in, self._e, self._slot, self._ev, self._n,
                                                                  self._missed, self._handles, self._sums)))
        self._in2 = np.zeros(cap, dtype=np.int32)
        self._res = np.zeros(4, dtype=np.int64)
        self._guess = np.zeros(7, dtype=np.int64)  # layer()'s guess computed in C (stream.c got_guess)
        self._guess_p = self._guess.ctypes.data
        self._res_p, self._stamps, self._guess_layer, self._guess_n = self._res.ctypes.data, None, -1, 0
        stamps = queue.stamps([p for paths in self.files.values() for p in paths])
        if stamps is not None:  # each layer's files checked in C by sluice_stream_layer (else it never runs)
            order = {path: i for i, path in enumerate(stamps)}
            width = max(map(len, self.files.values()))
            self._stamps = np.array(list(stamps.values()), dtype=np.int64).reshape(-1, 5)
            self._layer_files = np.full((n_layers, width), -1, dtype=np.int32)
            for layer, paths in self.files.items():
                self._layer_files[layer, : len(paths)] = [order[p] for p in paths]
            LIB.sluice_stream_files(self._h, self._stamps.ctypes.data, self._layer_files.ctypes.data, width,
                                    self._in2.ctypes.data)

    def _put(self, experts: Sequence[int]) -> int:
        n = len(experts)
        if n > len(self._in):
            raise ValueError(f"{n} experts in one call > {len(self._in)}")
        self._in[:n] = experts
        return n

    def _evicted(self) -> list[Key]:
        ne = int(self._n[0])
        return [divmod(k, self.E) for k in self._ev[:ne].tolist()] if ne else []

    def prefetch(self, layer: int, experts: Sequence[int]) -> tuple[list[tuple[int, int]], list[Key], list[int]]:
        """sluice_slots_prefetch's placement of a guess, the placed experts' reads queued and kept here: ((expert,
        slot) placed, keys evicted (their reads landed), the placed reads' counters summed)."""
        if len(experts) > len(self._in):
            experts = list(dict.fromkeys(experts))
        n = self._put(experts)
        m, evicted = self._placement(LIB.sluice_stream_prefetch(self._h, layer, n), layer, experts)
        return list(zip(self._e[:m].tolist(), self._slot[:m].tolist())), evicted, self._sums.tolist()

    def _placement(self, m: int, layer: int, experts) -> tuple[int, list[Key]]:
        """A guess's placement returned m (sluice_stream_prefetch's): (m, the keys it evicted), or its error (`experts`,
        a sequence or an int32 array, listed only then)."""
        if m == -2:
            raise bad_ids("prefetch", layer, experts, self.E)
        evicted = self._evicted()
        if m < 0:
            raise _refused(m, evicted)
        return m, evicted

    def acquire(self, layer: int, experts: Sequence[int], usage_row: int | None
                ) -> tuple[list[int], list[int], list[Key], list[tuple[int, int]], list[int]]:
        """sluice_stream_acquire: (slots, the misses' positions, keys evicted, (position, batch) of the reads handed
        over (a miss's, or a hit's guessed read not landed or failed: the caller's to adopt), the misses' counters
        summed). The uses are counted too (NativeSlots.used's). A refused read (no memory: RuntimeError carrying the
        handed batches) leaves the batch's experts pinned in the table: the caller forgets them."""
        n = self._put(experts)
        m = LIB.sluice_stream_acquire(self._h, layer, n, usage_row)
        if m < 0:
            self._raise(m, layer, experts, n)
        return self._acquired(n, m)

    def _acquired(self, n: int, m: int) -> tuple[list[int], list[int], list[Key], list[tuple[int, int]], list[int]]:
        """acquire's result from the bound arrays, n experts of which m missed."""
        missed = [j for j, f in enumerate(self._missed[:n].tobytes()) if f] if m else []
        return self._slot[:n].tolist(), missed, self._evicted(), self._handed(n), self._sums.tolist()

    def _handed(self, n: int) -> list[tuple[int, int]]:
        """(position, batch) of the reads an acquire of n experts handed over."""
        return [(j, h) for j, h in enumerate(self._handles[:n].tolist()) if h]

    def layer(self, layer: int, experts: Sequence[int], usage_row: int | None, ctx: int, next_layer: int,
              guess: Sequence[int], compute: tuple | None = None) -> int:
        """sluice_stream_layer: `layer`'s acquire of `experts` and, where every one is in memory, its experts run by
        `ctx` (DecodeExperts.prepared) while the guess of `next_layer` is queued, then its pins dropped (each file
        of the two layers checked first, in C: the versions TemplateQueue.stamps gave). Returns 0 (done: placed()
        says what the guess queued), 1 (the acquire done, an expert not in memory or the experts' call refused:
        acquired() gives what acquire returns; the guess not queued), 2 (a file changed, or no stamps: nothing
        done). Raises as acquire.

        `compute`: (Guess.packed()'s function and arguments, x's address, the Guess's ids' address and k, whether
        its reads may be queued): the guess of `next_layer` computed in the call (`guess` unused); guessed() then
        says what it chose."""
        if self._stamps is None:
            self.clear()
            return 2
        n = self._put(experts)
        m, self._guess_layer = len(guess), next_layer
        self._guess_n = compute[4] if compute is not None else m
        if compute is not None:
            self._guess[:6] = compute
            self._guess[6] = next_layer
            m = 0
        elif m:
            if m > len(self._in2):
                raise ValueError(f"a guess of {m} experts > {len(self._in2)}")
            self._in2[:m] = guess
        rc = LIB.sluice_stream_layer(self._h, layer, n, usage_row, ctx, next_layer, m, self._res_p,
                                     self._guess_p if compute is not None else None)
        if rc < 0:
            self._raise(rc, layer, experts, n)
        return rc

    def clear(self) -> None:
        """What layer() reports besides its status, as a call that did nothing leaves it (made() 0, nothing
        missed or placed)."""
        self._res[:] = 0

    def made(self) -> int:
        """After layer() with `compute`: 1 the guess made (guessed()), 2 made but left to torch.topk (the Guess's
        probabilities written), 0 not made (a file changed, the acquire failed, the experts' call was refused)."""
        return int(self._res[3])

    def guessed(self, k: int) -> list[int] | None:
        """After layer() with `compute`: the guess's ids ascending (made() 1), None where torch.topk has to rank the
        Guess's probabilities (2); raises where it was not made (0)."""
        how = self.made()
        if how == 0:
            raise RuntimeError("the guess was not computed")
        return self._in2[:k].tolist() if how == 1 else None

    def acquired(self, n: int) -> tuple[list[int], list[int], list[Key], list[tuple[int, int]], list[int]]:
        """After layer() returned 1: what acquire returns (n: the experts' count)."""
        return self._acquired(n, int(self._res[0]))

    def placed(self) -> tuple[list[int], list[Key], list[int]]:
        """After layer() returned 0: (the guess's experts placed, keys evicted, their reads' counters summed); raises
        StreamRefused where its reads were refused (the layer's experts ran all the same)."""
        m = int(self._res[1])
        if not m:
            return [], [], self._sums.tolist()
        # the guess's ids only as a slice: listing in2 (one entry per slot, 3,354 for the UD file at 640 MiB) took
        # ~20 us a layer of the model's thread (benchmarks/results/hybrid/placed-list.txt)
        m, evicted = self._placement(m, self._guess_layer, self._in2[: self._guess_n])
        return self._e[:m].tolist(), evicted, self._sums.tolist()

    def _raise(self, m: int, layer: int, experts: Sequence[int], n: int) -> NoReturn:
        """acquire's errors (m < 0)."""
        if m == -2:
            raise bad_ids("acquire", layer, experts, self.E)
        evicted = self._evicted()
        if m == -1:
            raise StreamRefused(NO_SLOT, evicted, [])
        raise _refused(m, evicted, self._handed(n))

    def forget(self, key: Key) -> int:
        """Wait for key's guessed read, if one is kept here, and drop it: its error kind (0 landed), -1 none."""
        layer, e = key
        return LIB.sluice_stream_forget(self._h, layer * self.E + e) if 0 <= e < self.E else -1

    def pending(self, key: Key) -> bool:
        layer, e = key
        return 0 <= e < self.E and bool(LIB.sluice_stream_pending(self._h, layer * self.E + e))

    def land_all(self) -> list[Key]:
        """Every guessed read kept here waited for and dropped: the keys whose read failed."""
        out = np.zeros(len(self._tmpl), dtype=np.int32)
        n = LIB.sluice_stream_land_all(self._h, out.ctypes.data)
        return [divmod(k, self.E) for k in out[:n].tolist()]

    def close(self) -> None:
        h, self._h = self._h, None
        if h:
            LIB.sluice_stream_close(h)  # every read kept here lands first

    def __del__(self) -> None:
        if getattr(self, "_h", None) and LIB is not None:
            self.close()


class StreamRefused(RuntimeError):
    """stream.c queued no read (an acquire's miss found no unpinned slot; no template for an expert: a bug; no memory
    for the batches). `evicted`: the keys the placement evicted (their reads kept in C landed); `handed`: (position,
    batch) of the reads handed over anyway (an acquire's hits')."""

    def __init__(self, msg: str, evicted: list[Key], handed: list[tuple[int, int]]):
        super().__init__(msg)
        self.evicted, self.handed = evicted, handed


def _refused(rc: int, evicted: list[Key], handed: list[tuple[int, int]] | None = None) -> StreamRefused:
    why = "an expert has no read template" if rc == -3 else "the native reader could not allocate the batches"
    return StreamRefused(f"the store's reads were not queued: {why}", evicted, handed or [])
