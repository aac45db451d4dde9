"""StreamingExpertStore: a budgeted cache of expert slots over all layers, filled from disk on demand.

Slot buffers are allocated once at load (one stack per projection, in the checkpoint's dtype) and written in place
by the reader; one cache over (layer, expert) is shared by all layers; the experts of the current acquire are pinned
so a later miss in the same pass can never evict them. acquire() returns with the misses' reads in flight (one
batch per expert), so the math overlaps them; ExpertBatch.wait(j) guards each slot.

Which expert leaves the cache is the policy's decision (store/policy.py: fair-share LRU with decayed use counts by
default, made in C by the slot table, store/slot_table.py, which also keeps the free and pinned slots); prefetch
bookkeeping (deferred predictions, the throttle, counters) is store/prefetch.py's. A decode token's acquires and
guessed reads run in C where the table and the reader are (store/stream_decode.py, stream_native.py, stream.c); its
other calls, and every call where they are not, run here.
"""

from __future__ import annotations

import functools
import time
from typing import Sequence

import torch

from ..host.memory import populate_pages, release_pages
from ..io.ranges import PAGE
from .base import ExpertBatch
from .budget import plan_budget
from .layout import ExpertLayout
from .pages import page_rows
from .placement import PLACED_MAX_COST, _alignment, _page_shifts
from .policy import GlobalLRU, Key
from .prefetch import ROUTER_THROTTLE, PrefetchTracker, Throttle
from .resident import expert_requests, typed_views
from .slot_table import make_table
from .stream_decode import DecodeStream, _landed
from .stream_native import NativeStream


#: experts per read batch of a prompt's read-ahead (prefetch(prompt=True)): the neighbouring expert ranges of one
#: batch coalesce into one read per stacked tensor, and a batch costs its planning and hand-off once
PROMPT_READ_GROUP = 4


class StreamingExpertStore(DecodeStream):
    """`slots` expert slots; misses are read by `reader` straight into the slot buffers."""

    def __init__(self, layout: ExpertLayout, reader, slots: int, overlap: bool = True,
                 policy: GlobalLRU | None = None, page_aligned: bool | None = None, budget: int | None = None,
                 throttle: Throttle = ROUTER_THROTTLE):
        """`overlap`: acquire returns with the misses' reads in flight (see acquire); False = it returns once every
        read has landed (the math then waits for the slowest expert before running any). `policy`: what to evict
        (default FairShareLFU, its choices made in C where slots.c is built; a policy given runs in Python).
        `page_aligned`: place each layer's experts in their slots at their file offsets modulo the files' O_DIRECT
        alignment (reader.alignment: 512 to 4096 bytes), so an O_DIRECT reader moves their whole blocks straight into
        the slots (no copy out of a staging buffer); None = when the reader reads the experts' files with O_DIRECT and
        placing costs at most PLACED_MAX_COST of a slot. It takes up to a block and a page per slot, paid for by fewer
        slots, never by more memory: as many as `budget` bytes hold (at most one per expert), else as many as `slots`
        slots' bytes hold. `throttle`: when a decode's guesses pause (store/prefetch.py)."""
        s = layout.spec
        self.layout, self.reader, self.overlap = layout, reader, overlap
        align = _alignment(layout, reader) if page_aligned is not False else 0
        placed_stride = -(-(layout.slot_nbytes + (align or PAGE) - 1) // PAGE) * PAGE
        if page_aligned is None:
            page_aligned = align > 0 and placed_stride - layout.slot_nbytes <= PLACED_MAX_COST * layout.slot_nbytes
        self._shift = _page_shifts(layout, align or PAGE) if page_aligned else {}
        stride = placed_stride if page_aligned else layout.slot_nbytes
        placed = (min(layout.total_experts, (budget if budget is not None else slots * layout.slot_nbytes) // stride)
                  if page_aligned else slots)
        if page_aligned and placed >= s.top_k:
            slots = placed
        elif page_aligned:  # too few slots to give any up: as stored, staged
            stride, self._shift = layout.slot_nbytes, {}
        self.n_slots = slots
        self.max_batch = slots
        # The only large allocation of the store: written in place for the whole run, each row one slot holding
        # one expert as stored (with a block of room when the layers are shifted, see _page_shifts), whole pages
        self.raw = page_rows(slots, stride)  # [S, stride]
        # per shift: raw [S, slot bytes] viewed from that byte of each row, and its typed gate_up [S, 2I, H] and
        # down [S, H, I] when plain (else None)
        self._shifted: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = {}
        self._views: dict[int, memoryview] = {}  # slot -> a byte view of raw[slot], made at its first read
        # (layer, expert) -> its reads planned once (reader.template), None where the reader has no templates
        self._templates: dict[Key, object] | None = {} if hasattr(reader, "submit_templates") else None
        # what each slot holds, the free and pinned slots, and the policy's victims (store/slot_table.py): in C over
        # FairShareLFU by default, in Python over `policy` when one is given
        self.table = make_table(layout.layers, s.n_layers, s.num_experts, s.top_k, slots, policy)
        self._pending: dict[Key, object] = {}  # prefetched entries whose read may be in flight
        self.prefetching = PrefetchTracker(throttle)
        self.usage = torch.zeros((s.n_layers, s.num_experts), dtype=torch.int64)  # routing counts
        self.table.count_into(self.usage.numpy())  # the same memory: counted per expert (a torch index_put ~46 us)
        self.hits = self.misses = self.evictions = self.bytes_read = 0
        self.misses_by_layer = [0] * s.n_layers  # expert reads per layer (prefetches not counted)
        self.io_wait_s = 0.0
        self._batch: tuple[int, list[int]] = (-1, [])  # the current acquire's (layer, experts)
        self._inflight: dict[int, object] = {}  # its reads not waited for yet: j -> future
        self._lent = 0  # the last slots, given back to the kernel while a prompt uses their memory (lend)
        self.loans = self.lent_bytes = 0  # prompts that borrowed slots; the most bytes one borrowed
        self._populating = None  # lend_back's thread faulting the returned slots' pages in
        # a decode token's acquires and guessed reads in C (store/stream_native.py), made at the first that can use
        # it (False: this store cannot); _streamed: guessed reads may be kept there (land_all not called since)
        self._stream: NativeStream | None | bool = None
        self._streamed = False
        self._allowed: tuple[int, list[int]] | None = None  # a deferred guess the throttle passed (run_layer)
        self._ticks = 0.0  # when run_layer looks the files up in Python next (time.monotonic)
        self._late: tuple | None = None  # guess_later's guess, not made yet

    @classmethod
    def with_budget(cls, layout: ExpertLayout, reader, expert_budget: int, memory: int,
                    overlap: bool = True, throttle: Throttle = ROUTER_THROTTLE) -> "StreamingExpertStore":
        """As many slots as `memory` leaves after the resident weights (`memory - expert_budget`); BudgetError
        (with the smallest budget that works) when fewer than top_k slots fit."""
        s = layout.spec
        plan = plan_budget(memory, memory - expert_budget, layout.expert_nbytes, s.top_k, layout.total_experts)
        return cls(layout, reader, plan.slots, overlap=overlap, budget=expert_budget, throttle=throttle)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def _at(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """raw, gate_up, down of `layer`'s shift (see __init__)."""
        shift = self._shift.get(layer, 0)
        views = self._shifted.get(shift)
        if views is None:
            raw = self.raw[:, shift : shift + self.layout.slot_nbytes]  # [S, slot bytes]
            views = self._shifted[shift] = (raw, *typed_views(self.layout, raw))
        return views

    def _requests(self, layer: int, expert: int, slot: int) -> list:
        """expert_requests for `slot`, its destinations slices of one memoryview per slot made once: a tensor slice
        and its conversion to a buffer (io/ranges.py as_buffer) cost ~10 us per part, three parts per miss."""
        view = self._views.get(slot)
        if view is None:
            view = self._views[slot] = memoryview(self.raw[slot].numpy())
        at = self._shift.get(layer, 0)
        return [(part.range, view[at + part.dest_offset : at + part.dest_offset + part.range.nbytes])
                for part in self.layout.parts(layer, expert)]

    def _submit(self, layer: int, entries: list[tuple[int, int]]) -> list:
        """Queue the reads of `layer`'s experts into their slots ((expert, slot) each) by one reader call, one future
        per expert, in order. Each expert's reads are planned once, at its first miss (reader.template: the same
        ranges into another slot only move their destinations), where the reader can; else planned each time."""
        if self._templates is not None:
            raw0, stride = self.raw.data_ptr(), self.raw.stride(0)
            items = []
            for e, slot in entries:
                t = self._templates.get((layer, e))
                if t is None:
                    if not self._plan():  # this reader plans every time
                        self._templates = None
                        return self._submit(layer, entries)
                    t = self._templates[(layer, e)]
                items.append((t, raw0 + slot * stride))
                self.bytes_read += t.counts[1]
            return self.reader.submit_templates(items)
        requests = [self._requests(layer, e, slot) for e, slot in entries]
        self.bytes_read += sum(r.nbytes for b in requests for r, _ in b)
        return self.reader.submit_each(requests)

    def _plan(self) -> bool:
        """Plan the reads of every expert (reader.templates_at: each part's range into its place in a slot, from the
        slot's first byte), one call a layer, at the first miss; False where the reader has no templates.

        All of them at once: one call an expert took ~16 us (plan.c), ~30 beside the readers inside a step, and the
        ~257 experts a token of the issue-30 model missed for the first time cost 7-10 ms of each early token; 256
        in one call take 6-7 us each, the model's 40 layers 79 ms once, in the prompt or first token
        (results/hybrid/plan-layer.txt). ~0.6 KiB an expert, kept for the run (io/templates.py ReadTemplate)."""
        for layer in self.layout.layers:
            at = self._shift.get(layer, 0)
            ts = self.reader.templates_at([[(part.range, at + part.dest_offset) for part in self.layout.parts(layer, e)]
                                           for e in range(self.layout.spec.num_experts)])
            if ts is None:
                return False
            self._templates.update(((layer, e), t) for e, t in enumerate(ts))
        return True

    def _evicted(self, keys: Sequence[Key], landed: bool = False) -> None:
        """The table evicted `keys`: a guessed read still in flight into one of their slots lands before the slot is
        reused (the caller has not queued its new read yet). `landed`: stream.c evicted them, their reads kept there
        landed already."""
        stream = None if landed else self._stream or None
        for key in keys:
            if stream is not None:
                stream.forget(key)  # its guessed read kept in C, if any, lands
            fut = self._pending.pop(key, None)
            if fut is not None:
                try:
                    fut.result()
                except Exception:  # noqa: BLE001 - its bytes are dropped with the entry
                    pass
            self.prefetching.evicted(key)
        self.evictions += len(keys)

    def acquire(self, layer: int, experts: Sequence[int], hold: bool = False) -> ExpertBatch:
        """Pin `experts` of `layer` in slots and queue the misses' reads; return without waiting for them. Then
        issue the prediction prefetch_next deferred, unless `hold`: the caller issues it (issue_deferred) before
        release, while these experts stay pinned.

        One read batch per missing expert, queued in the order of `experts` by one reader call (submit_each: the
        files are checked once per acquire, not once per expert): the reader's FIFO fills them in that order, so the
        math runs the hits while the first miss loads, then each miss as soon as its bytes land (batch.wait(j)).
        Results do not depend on that order: the block sums the experts in a fixed order.
        """
        return self._acquire(layer, experts, hold)

    def _acquire(self, layer: int, experts: Sequence[int], hold: bool, routed: bool = False) -> ExpertBatch:
        """acquire; `routed`: the router's choice already counted (prefetching.routed)."""
        if len(experts) > self.max_batch:
            raise ValueError(f"acquire of {len(experts)} experts > {self.max_batch} slots")
        self.settle()  # a previous batch the math abandoned: its reads land before any slot is reused
        inflight: dict[int, object] = {}  # j -> the future that fills slot j
        self._batch, self._inflight = (layer, list(experts)), inflight
        stream = self._fast()
        t0 = time.perf_counter()
        try:
            if stream is not None:  # all below, and the uses counted, in one C call
                slots, missed = self._acquire_fast(stream, layer, experts, inflight)
            else:
                self._land_stream()
                # the hits pinned first (a miss cannot evict an expert this same call is about to use), then the
                # misses placed in free or evicted slots and pinned; their reads queued in one call, one batch each
                slots, missed, evicted = self.table.acquire(layer, experts)
                if evicted:
                    self._evicted(evicted)
                if missed:
                    for j, fut in zip(missed, self._submit(layer, [(experts[j], slots[j]) for j in missed])):
                        inflight[j] = fut
        except BaseException:
            self._fail()
            raise
        finally:
            self.io_wait_s += time.perf_counter() - t0
        # The counts, the hits' recency and the prefetch's score once the reads are queued (the disk starts ~0.1 ms
        # sooner a layer): none of them changes a victim above, the hits being pinned and the misses not yet cached
        if stream is None:
            self.table.used(layer, experts, missed)  # the hits made the most recent, too
        if not routed:
            self.prefetching.routed(layer, experts)
        return self._acquired(layer, experts, slots, missed, inflight, hold)

    def _acquired(self, layer: int, experts: Sequence[int], slots: list[int], missed: list[int], inflight: dict,
                  hold: bool) -> ExpertBatch:
        """acquire's end: the counters, the prefetch's hits, the batch (the table's uses and the router's choice
        counted before)."""
        self.misses += len(missed)
        self.misses_by_layer[layer] += len(missed)
        missed_set = set(missed)
        self.hits += len(experts) - len(missed)
        self.prefetching.hits(layer, experts, missed_set)
        if self._pending:  # Python's guessed reads (the C path's are looked at in C)
            for j, e in enumerate(experts):
                fut = None if j in missed_set else self._pending.pop((layer, e), None)
                # its prefetch still in flight (or failed): the math waits for it like for a miss (and gets its
                # error); one landed needs nothing more (~3 us a guessed expert less on the model's thread)
                if fut is not None and not _landed(fut):
                    inflight[j] = fut
        raw, gate_up, down = self._at(layer)
        batch = ExpertBatch(gate_up, down, slots, {j: functools.partial(self._wait, j) for j in inflight},
                            raw=raw, format=self.layout.format(layer),
                            landed={j: fut.done for j, fut in inflight.items() if hasattr(fut, "done")})
        if not self.overlap:
            batch.wait_all()
        if not hold:
            self.issue_deferred()
        return batch

    @property
    def deferred(self) -> bool:
        """Whether a prediction prefetch_next deferred waits to be issued."""
        return self.prefetching.deferred is not None or self._allowed is not None or self._late is not None

    def issue_deferred(self) -> None:
        """Issue the prediction prefetch_next deferred, if any, now: after an acquire, whose pinned experts it then
        cannot evict."""
        if (late := self._late) is not None:  # guess_later's, computed now
            self._late = None
            layer, guess, x, chosen = late
            self.prefetch(layer, chosen(guess, guess(x)))
        elif (allowed := self._allowed) is not None:  # allowed by the throttle already (run_layer)
            self._allowed = None
            self._prefetch(*allowed)
        elif (deferred := self.prefetching.take_deferred()) is not None:
            self.prefetch(*deferred)

    def _wait(self, j: int) -> None:
        """Block until slot j of the current batch is filled; on a read error forget the whole batch."""
        fut = self._inflight.pop(j, None)
        if fut is None:
            return
        t0 = time.perf_counter()
        try:
            fut.result()
        except BaseException:
            self._fail()
            raise
        finally:
            self.io_wait_s += time.perf_counter() - t0

    def _fail(self) -> None:
        """A read of the current batch failed: let its other reads land (they write into our slots), then forget
        every expert of the batch, since their slots may hold partial bytes that no later step may trust."""
        self._land()
        layer, experts = self._batch
        self._forget(layer, experts)

    def _land(self) -> bool:
        """Wait for every read of the current batch still in flight; True if one failed."""
        failed = False
        t0 = time.perf_counter()
        for fut in self._inflight.values():
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - reported by _wait to whoever used the slot; here only landing
                failed = True
        self.io_wait_s += time.perf_counter() - t0
        self._inflight = {}
        return failed

    def settle(self) -> None:
        """Land the reads of the current batch that the math never waited for (it failed before, or did not need
        them), forgetting the batch if one of them failed."""
        if self._inflight and self._land():
            layer, experts = self._batch
            self._forget(layer, experts)

    def _forget(self, layer: int, experts: Sequence[int]) -> None:
        for e in experts:
            if (layer, e) in self.table:
                self._drop((layer, e))
        self.table.unpin_all()

    def _drop(self, key: Key) -> None:
        """Take `key` out of the cache and free its slot: not a cache decision, so no eviction is counted."""
        slot = self.table.remove(key)
        self._evicted([key])
        self.evictions -= 1
        self.table.push_free(slot)

    def release(self, layer: int) -> None:
        self.settle()
        self.table.unpin_all()

    def lend(self, nbytes: int, keep: int) -> int:
        """Give up to `nbytes` of slot memory back to the kernel while a prompt's passes use it (store/budget.py
        PromptLoan): the last slots, as one range of pages (madvise DONTNEED: out of the RSS and the cgroup's charge),
        never leaving fewer than `keep` (nor top_k); their experts are dropped, every read in flight landed first,
        and max_batch shrinks with them. Returns the bytes released (0: nothing lent); lend_back() returns them."""
        if self._lent or nbytes <= 0 or self.table.pinned:
            return 0
        self._populated()
        stride = self.raw.shape[1]
        n = min(-(-nbytes // stride), self.n_slots - max(keep, self.layout.spec.top_k))
        if n <= 0:
            return 0
        self.settle()
        self._land_stream()
        for key in list(self._pending):  # prefetched reads may be writing any slot: they land first
            fut = self._pending.pop(key)
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - a failed prefetch leaves bytes no one may trust: dropped below
                if key in self.table:
                    self._drop(key)
        first = self.n_slots - n
        for slot in range(first, self.n_slots):
            if (key := self.table.owner(slot)) is not None:
                self._drop(key)
        self.table.set_free([slot for slot in self.table.free if slot < first])
        self.max_batch = first
        self._lent = n
        released = release_pages(self.raw[first].data_ptr(), n * stride)
        self.loans += 1
        self.lent_bytes = max(self.lent_bytes, released)
        return released

    def lend_back(self) -> None:
        """The slots lend() gave up, back and empty; their pages are faulted in now (as at load), not inside a later
        step, by a thread beside the caller where the kernel can (host/memory.py populate_pages): 151 MiB in ~20 ms
        (the Intel VM, in a cgroup), but up to ~0.3 s where its host had taken the pages back, which a prompt's
        last pass then waited for."""
        if not self._lent:
            return
        first = self.n_slots - self._lent
        self._populating = populate_pages(self.raw[first:], background=True)
        self.table.set_free(list(range(self.n_slots - 1, first - 1, -1)) + self.table.free)
        self.max_batch, self._lent = self.n_slots, 0

    def _populated(self) -> None:
        """Wait for lend_back's pages to be in (before they are lent again, or the store closes)."""
        if self._populating is not None:
            self._populating.join()
            self._populating = None

    def prefetch(self, layer: int, experts: Sequence[int], prompt: bool = False) -> None:
        """Start background reads of predicted `experts` of `layer` into free or evicted slots, now.

        Never evicts a pinned slot, an entry it is placing in this same call, nor a predicted one already in memory
        (trading one guess for another only churns), and stops when no other slot is
        left. In-flight bytes are bounded by one layer's prediction. The true router still decides: a wrong guess
        only costs the read. `prompt`: a prompt's read-ahead (models/layers/moe.py): read batches of PROMPT_READ_GROUP
        experts in expert order, so the next layer runs each group as soon as it lands, counted apart from decode's
        prefetch (stats "prompt_prefetch_*") and never paused by its throttle.
        """
        if not prompt and not self.prefetching.allow(layer, experts):
            return
        self._prefetch(layer, experts, prompt)

    def _prefetch(self, layer: int, experts: Sequence[int], prompt: bool = False) -> None:
        """prefetch, the throttle passed."""
        if not prompt and (stream := self._fast()) is not None and self._prefetch_fast(stream, layer, experts):
            return
        self._land_stream()
        # never evicting a pinned slot, a predicted expert in memory (trading one guess for another only churns) nor
        # one it places; their victims from one sort where the policy can, as acquire's misses'
        entries, evicted = self.table.prefetch(layer, experts)  # (expert, slot) placed
        if evicted:
            self._evicted(evicted)
        keys = [(layer, e) for e, _ in entries]
        if not keys:
            return
        futures: list = []
        try:
            if prompt:  # a few experts per read batch: their neighbouring ranges coalesce (PROMPT_READ_GROUP)
                # in expert order (the placement above followed the prediction's): neighbours in the stacked
                # tensors share a batch, and they land in the order the layer runs them (ascending ids)
                order = sorted(range(len(keys)), key=lambda i: keys[i][1])
                keys = [keys[i] for i in order]
                batches = [self._requests(layer, *entries[i]) for i in order]
                for g in range(0, len(batches), PROMPT_READ_GROUP):
                    group = batches[g : g + PROMPT_READ_GROUP]
                    futures += [self.reader.submit([r for b in group for r in b])] * len(group)
                self.bytes_read += sum(r.nbytes for b in batches for r, _ in b)
            else:  # one read batch per expert, each awaited on its own (and planned once: _submit)
                futures = self._submit(layer, entries)
        finally:
            for key, fut in zip(keys, futures):  # submitted: a later acquire waits for these reads to land
                self._pending[key] = fut
            for key in keys[len(futures):]:  # never submitted (the reader raised): their slots hold no bytes
                self._drop(key)
        self.prefetching.placed(keys, prompt)

    def guessing(self) -> bool:
        """Whether the model should guess the next layer's experts now (False while the throttle pauses)."""
        return self.prefetching.want()

    def prefetch_next(self, layer: int, experts: Sequence[int]) -> None:
        """Like prefetch, issued right after the next acquire has pinned its experts (so the reads overlap that
        layer's expert math and can never evict what it is about to use)."""
        self._allowed = self._late = None  # a guess left unissued: this newer one replaces it
        self.prefetching.defer(layer, experts)

    def guess_later(self, layer: int, guess, x: torch.Tensor, chosen) -> None:
        """prefetch_next of what `guess` (the prerouter's native Guess) picks for x [1, H], the guess itself made
        when it is to be issued: by run_layer in C while the layer's experts start, else by issue_deferred (`chosen`:
        the Guess's result as ids ascending, RouterPrerouter.chosen). x must stay as it is until then."""
        self._allowed = None
        self.prefetching.take_deferred()
        self._late = (layer, guess, x, chosen)

    def stats(self) -> dict:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "misses_by_layer": list(self.misses_by_layer),
            "evictions": self.evictions,
            "bytes_read": self.bytes_read,
            "io_wait_s": round(self.io_wait_s, 6),
            "slots": self.n_slots,
            "prompt_loans": self.loans,  # prompts whose passes borrowed slots (lend), and the most bytes one took
            "prompt_lent_bytes": self.lent_bytes,
            "slot_bytes": self.nbytes,
            **self.prefetching.stats(self.layout.expert_nbytes),
        }

    def close(self) -> None:
        self._land()
        if self._stream:
            self._stream.close()  # its guessed reads land first
        self._stream = False
        self._populated()
