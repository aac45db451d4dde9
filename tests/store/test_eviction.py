"""The streaming store's eviction policy on a synthetic access pattern (no files: a fake layout and reader)."""

from __future__ import annotations

import math
import random
import time
from types import SimpleNamespace

import pytest
import torch

from sluice.io.ranges import ReadRange
from sluice.store.layout import ExpertPart
from sluice.store.policy import GlobalLRU
from sluice.store.streaming import StreamingExpertStore

LAYERS, EXPERTS, TOP_K = 6, 16, 4


class _NullReader:
    def read(self, requests):
        pass

    def submit(self, requests):
        return SimpleNamespace(result=lambda: None)

    def submit_each(self, batches):
        return [self.submit(b) for b in batches]


def fake_layout(spec, layers, parts, gate_up_shape, down_shape, dtype=torch.bfloat16) -> SimpleNamespace:
    """What the streaming store reads of an ExpertLayout, for plain experts: one slot = gate_up bytes then down."""
    gu, dn = math.prod(gate_up_shape) * dtype.itemsize, math.prod(down_shape) * dtype.itemsize
    fmt = SimpleNamespace(down_offset=gu)
    return SimpleNamespace(spec=spec, layers=layers, plain_dtype=dtype, gate_up_shape=gate_up_shape,
                           down_shape=down_shape, slot_nbytes=gu + dn, expert_nbytes=gu + dn, parts=parts,
                           format=lambda layer: fmt)


def _store(slots: int, policy=None, **kw) -> StreamingExpertStore:
    spec = SimpleNamespace(n_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K, moe_layers=[True] * LAYERS)
    part = [ExpertPart("gate_up", 0, ReadRange("/dev/null", 0, 16)), ExpertPart("down", 16, ReadRange("/dev/null", 0, 8))]
    layout = fake_layout(spec, list(range(LAYERS)), lambda layer, e: part, (4, 2), (2, 2))
    return StreamingExpertStore(layout, _NullReader(), slots, policy=policy, **kw)


def _sweep(store: StreamingExpertStore, tokens: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    for _ in range(tokens):
        for layer in range(LAYERS):
            store.acquire(layer, sorted(rng.sample(range(EXPERTS), TOP_K)))
            store.release(layer)


def test_plain_lru_gets_nothing_from_a_cyclic_sweep():
    plain = _store(LAYERS * TOP_K // 2, GlobalLRU())
    _sweep(plain, 200)
    assert plain.hits / (plain.hits + plain.misses) < 0.02


@pytest.mark.parametrize("slots", [LAYERS * TOP_K // 2, LAYERS * TOP_K - 2])
def test_fair_share_beats_plain_lru_below_one_token_working_set(slots):
    fair, plain = _store(slots), _store(slots, GlobalLRU())
    _sweep(fair, 200)
    _sweep(plain, 200)
    fair_rate = fair.hits / (fair.hits + fair.misses)
    plain_rate = plain.hits / (plain.hits + plain.misses)
    # uniform routing: a layer keeping q of E experts hits ~q/E of its top-k
    assert fair_rate > 0.5 * fair.table.quota / EXPERTS
    assert fair_rate > plain_rate


def test_plain_lru_when_cache_holds_everything():
    store = _store(LAYERS * EXPERTS)
    _sweep(store, 50)
    assert store.evictions == 0 and store.misses == LAYERS * EXPERTS - sum(
        1 for L in range(LAYERS) for e in range(EXPERTS) if store.usage[L, e] == 0
    )


def test_acquire_never_evicts_its_own_hits():
    store = _store(TOP_K)
    store.acquire(0, [0, 1, 2, 3])
    store.release(0)
    store.acquire(0, [1, 2, 3, 4])  # three hits must survive the miss of 4
    assert store.hits == 3 and store.misses == 5


def test_prefetch_pauses_when_it_is_mostly_wasted():
    store = _store(LAYERS * TOP_K)
    rng = random.Random(1)
    for _ in range(100):
        for layer in range(LAYERS):
            store.acquire(layer, sorted(rng.sample(range(12), TOP_K)))
            # predict experts the next acquire never asks for (12..15 are never routed below)
            store.prefetch((layer + 1) % LAYERS, [12, 13, 14, 15])
            store.release(layer)
    st = store.stats()
    assert st["prefetch_paused"] > 0
    assert st["prefetch_issued"] < 100 * LAYERS * 4  # it stopped issuing for a while


def _throttled_rounds(tracker, right: int, n: int) -> list[bool]:
    """n decode guesses of 4 reads for layer 1, `right` of them routed by its next acquire: whether each was read."""
    out = []
    for _ in range(n):
        if not tracker.want() or not tracker.allow(1, [0, 1, 2, 3]):
            out.append(False)
            continue
        tracker.placed([(1, e) for e in range(4)])
        tracker.routed(1, list(range(right)) + [10 + i for i in range(4 - right)])
        out.append(True)
    return out


def test_the_auto_throttle_pauses_poor_guesses_longer_each_time_and_forgets_it_on_good_ones():
    """The throttle scores each guessed read by the layer's next acquire: a window of 8 reads half wrong pauses
    (precision 0.8) for 2 guesses, then 8 (growth 4), then 32 (the cap); good guesses never pause, and a window that
    passes brings the cooldown back to 2. Not asked (want() False) while paused: the model skips the guess."""
    from sluice.store.prefetch import PrefetchTracker, Throttle

    t = PrefetchTracker(Throttle(precision=0.8, window=8, cooldown=2, growth=4, max_cooldown=32))
    T, F = True, False
    assert _throttled_rounds(t, 2, 19) == [T, T, F, F, F, T, T, F] + [F] * 8 + [T, T, F]
    assert _throttled_rounds(t, 2, 35) == [F] * 32 + [T, T, F]  # 32: the cap (8 * 4 = 32, then no more)
    assert t.paused == 2 + 8 + 32  # want() calls answered False (a pause starting in allow() is not one)
    assert all(_throttled_rounds(t, 4, 40)[32:])  # the cap's cooldown, then right guesses: never paused again
    # the window passed (the cooldown is back to 2); the next guess half wrong fails the window of the last 8 reads
    assert _throttled_rounds(t, 2, 6) == [T, F, F, F, T, T]
    assert t.issued == 4 * (6 + 2 + 8 + 3)


def test_auto_pauses_what_router_keeps_and_keeps_right_guesses():
    """Guessed reads 75% right pause under AUTO_THROTTLE (80%), never under ROUTER_THROTTLE (20%). On a store, guesses
    that are all right never pause under auto, and wrong ones turn its guessing() off (the model then skips them)."""
    from sluice.store.prefetch import AUTO_THROTTLE, ROUTER_THROTTLE, PrefetchTracker

    auto, router = PrefetchTracker(AUTO_THROTTLE), PrefetchTracker(ROUTER_THROTTLE)
    assert not all(_throttled_rounds(auto, 3, 200)) and all(_throttled_rounds(router, 3, 200))

    def run(right: bool) -> tuple[dict, int]:
        store = _store(LAYERS * TOP_K, throttle=AUTO_THROTTLE)
        rng = random.Random(3)
        routes = [sorted(rng.sample(range(12), TOP_K)) for _ in range(60 * LAYERS + 1)]  # call i's experts
        skipped = 0
        for i in range(60 * LAYERS):
            layer = i % LAYERS
            if store.guessing():  # as the model guesses: before this layer's acquire, the next layer's experts (or
                # ones it never routes: 12..15), read once this acquire has pinned its own
                store.prefetch_next((layer + 1) % LAYERS, routes[i + 1] if right else [12, 13, 14, 15])
            else:
                skipped += 1
            store.acquire(layer, routes[i])
            store.release(layer)
        return store.stats(), skipped

    (good, skipped), (poor, poor_skipped) = run(True), run(False)
    assert good["prefetch_paused"] == skipped == 0 and good["prefetch_issued"] > 0
    assert poor["prefetch_paused"] == poor_skipped > 0


class _MarkingReader:
    """Fills each destination with a byte derived from the range's offset, so a slot's bytes name its expert."""

    @staticmethod
    def _fill(requests):
        for rng, dest in requests:  # a tensor or a writable buffer, as the reader protocol allows
            t = dest if isinstance(dest, torch.Tensor) else torch.frombuffer(dest, dtype=torch.uint8)
            t.fill_(rng.offset // 64 % 251)

    def read(self, requests):
        self._fill(requests)

    def submit(self, requests):
        self._fill(requests)
        return SimpleNamespace(result=lambda: None)

    def submit_each(self, batches):
        return [self.submit(b) for b in batches]


def _marked_store(slots: int) -> StreamingExpertStore:
    spec = SimpleNamespace(n_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K, moe_layers=[True] * LAYERS)

    def parts(layer, e):
        off = (layer * EXPERTS + e) * 64
        return [ExpertPart("gate_up", 0, ReadRange("/fake", off, 16)), ExpertPart("down", 16, ReadRange("/fake", off, 8))]

    layout = fake_layout(spec, list(range(LAYERS)), parts, (4, 4), (2, 4), torch.uint8)
    return StreamingExpertStore(layout, _MarkingReader(), slots)


@pytest.mark.parametrize("slots", [TOP_K + 2, LAYERS * TOP_K // 2, LAYERS * TOP_K + 3])
def test_slots_hold_their_experts_bytes_under_prefetch(slots):
    """Regression: a prefetch call could evict an entry it had just placed (older entries of the layer were still
    marked in flight), leaving a slot labelled with one expert and filled with another."""
    store, rng = _marked_store(slots), random.Random(7)
    for _ in range(150):
        for layer in range(LAYERS):
            experts = sorted(rng.sample(range(EXPERTS), TOP_K))
            batch = store.acquire(layer, experts)
            batch.wait_all()
            for j, e in enumerate(experts):
                want = (layer * EXPERTS + e) * 64 // 64 % 251
                assert int(batch.gate_up[batch.slots[j]].flatten()[0]) == want, (layer, e)
                assert bool((batch.down[batch.slots[j]] == want).all()), (layer, e)
            # half-right predictions with a margin, like a real prerouter
            guess = sorted(set(rng.sample(experts, TOP_K // 2)) | set(rng.sample(range(EXPERTS), TOP_K)))
            store.prefetch((layer + 1) % LAYERS, guess)
            store.release(layer)


class _LateReader(_MarkingReader):
    """Fills each batch in a thread after a delay, later batches sooner: reads land out of order."""

    def __init__(self):
        self.delay = 0.03

    def submit(self, requests):
        import threading
        from concurrent.futures import Future

        fut, delay = Future(), self.delay
        self.delay = max(0.0, self.delay - 0.01)

        def fill():
            time.sleep(delay)
            self._fill(requests)
            fut.set_result(None)

        threading.Thread(target=fill, daemon=True).start()
        return fut


def test_reads_land_before_use_and_before_release():
    """acquire returns with reads in flight; wait(j) makes slot j's bytes right; release lands what nobody waited
    for, so the next acquire can never hand out a slot a late read is still writing."""
    store = _marked_store(TOP_K + 1)
    store.reader = _LateReader()
    experts = [1, 2, 3, 5]
    batch = store.acquire(0, experts)
    assert not any(batch.ready(j) for j in range(len(experts)))  # all misses, all queued
    batch.wait(2)
    assert int(batch.gate_up[batch.slots[2]].flatten()[0]) == 3 % 251
    store.release(0)  # never waited for 0, 1, 3: they must have landed now
    for j, e in enumerate(experts):
        assert bool((batch.gate_up[batch.slots[j]] == e % 251).all()), e
    store.reader.delay = 0.03
    nxt = store.acquire(1, [0, 4, 6, 7])  # evicts layer 0's experts into the same slots
    nxt.wait_all()
    for j, e in enumerate([0, 4, 6, 7]):
        assert bool((nxt.down[nxt.slots[j]] == (EXPERTS + e) % 251).all()), e
    store.release(1)


def test_a_layers_favourite_expert_survives_a_short_absence():
    """Within a layer the victim is the least used (decayed count), not the least recent: an expert the router
    keeps choosing stays cached while a run of one-off experts passes through (plain LRU would evict it first)."""
    spec = SimpleNamespace(n_layers=1, num_experts=8, top_k=1, moe_layers=[True])
    part = [ExpertPart("gate_up", 0, ReadRange("/dev/null", 0, 16)), ExpertPart("down", 16, ReadRange("/dev/null", 0, 8))]
    layout = fake_layout(spec, [0], lambda layer, e: part, (4, 2), (2, 2))
    store = StreamingExpertStore(layout, _NullReader(), 3)
    for e in [0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 0]:  # 0 is the favourite; 1..5 each come once
        store.acquire(0, [e]).wait_all()
        store.release(0)
    st = store.stats()
    assert (st["hits"], st["misses"]) == (5, 6)  # 0's last use is a hit: 1..4 were evicted in its place


def test_fair_share_policy_on_its_own():
    """The policy is a plain object: built and driven without a store, slots or a reader."""
    from sluice.store.policy import FairShareLFU

    pol = FairShareLFU(layers=[0, 1], num_experts=4, top_k=1, slots=5)  # quota (5 - 1) // 2 = 2 per layer
    assert pol.quota == 2
    for slot, key in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        pol.insert(key, slot)
    for _ in range(3):
        pol.used(0, [1])  # expert 1 of layer 0 is the favourite
    pol.used(0, [0])
    anything = lambda key, slot: True  # noqa: E731
    # layer 0 holds its share: it replaces its own least used expert, 0, though 0 was used last
    assert pol.victim(0, anything) == (0, 0)
    # a pinned entry is never chosen
    assert pol.victim(0, lambda key, slot: key != (0, 0)) == (0, 1)
    assert pol.remove((0, 0)) == 0 and (0, 0) not in pol and len(pol) == 3
    # layer 0 is now under its share: it takes the oldest entry of a layer above its share (none is), else oldest
    assert pol.victim(0, anything) == (0, 1)


def test_fair_share_victims_are_the_rule_written_out():
    """FairShareLFU.victim picks, over random inserts, touches, removals and pins, what its rule says walking the
    whole cache: at or above its share the layer's own least-used usable entry (least recent among equals), else
    the globally least recent usable entry of a layer above its share, else the globally least recent usable one
    (victim compares each over-share layer's first entry by recency instead of walking every slot)."""
    from sluice.store.policy import FairShareLFU

    layers, experts = list(range(5)), 12
    rng = random.Random(3)
    for trial in range(20):
        p = FairShareLFU(layers, experts, top_k=2, slots=rng.choice([8, 14, 30]))
        order: list = []  # the global recency order, oldest first, kept by hand
        for _ in range(300):
            op = rng.random()
            key = (rng.choice(layers), rng.randrange(experts))
            if op < 0.4 and key not in order:
                p.insert(key, rng.randrange(100))
                order.append(key)
            elif op < 0.7 and key in order:
                p.touch(key)
                order.remove(key)
                order.append(key)
            elif op < 0.8 and key in order:
                p.remove(key)
                order.remove(key)
            else:
                p.used(key[0], [rng.randrange(experts) for _ in range(2)])
            pinned = set(rng.sample(order, k=min(len(order), rng.randrange(4))))
            usable = lambda k, s: k not in pinned  # noqa: E731
            layer = rng.choice(layers)
            own = [k for k in order if k[0] == layer]
            want = None
            if len(own) >= p.quota:
                cands = [k for k in own if usable(k, 0)]
                if cands:
                    want = min(cands, key=lambda k: (p._score[layer][k[1]], own.index(k)))
            if want is None:
                count = {L: sum(1 for k in order if k[0] == L) for L in layers}
                want = next((k for k in order if count[k[0]] > p.quota and usable(k, 0)), None)
            if want is None:
                want = next((k for k in order if usable(k, 0)), None)
            assert p.victim(layer, usable) == want


def test_fair_share_victims_at_once_are_what_victim_picks_in_turn():
    """FairShareLFU.victims (a layer's misses' victims from one sort) names, over random states, exactly the entries
    n calls of victim() evict in turn, each new expert inserted pinned after its victim is removed, as the store's
    acquire does; None where the layer is under its share or has too few usable entries."""
    import copy

    from sluice.store.policy import FairShareLFU

    layers, experts = list(range(4)), 16
    rng = random.Random(5)
    named = 0
    for trial in range(200):
        p = FairShareLFU(layers, experts, top_k=4, slots=rng.choice([12, 20, 40]))
        slot = 0
        for _ in range(rng.randrange(10, 120)):
            key = (rng.choice(layers), rng.randrange(experts))
            if key not in p:
                p.insert(key, slot)
                slot += 1
            elif rng.random() < 0.5:
                p.touch(key)
            p.used(key[0], rng.sample(range(experts), 4))
        layer, n = rng.choice(layers), rng.randrange(1, 5)
        pinned = set(rng.sample(sorted(p), k=min(len(p), rng.randrange(3))))
        new = [(layer, e) for e in range(experts) if (layer, e) not in p][:n]
        got = p.victims(layer, len(new), lambda k, s: k not in pinned)
        own = [k for k in p if k[0] == layer]
        usable_own = sum(1 for k in own if k not in pinned)
        turn = copy.deepcopy(p)  # victim() n times on a copy, as acquire did
        want, stuck = [], False
        for k in new:
            v = turn.victim(layer, lambda k, s: k not in pinned)
            if v is None:
                stuck = True
                break
            want.append(v)
            s = turn.remove(v)
            turn.insert(k, s)
            pinned.add(k)
        if got is not None:
            named += 1
            assert not stuck and got == want, (trial, got, want)
        else:
            assert len(own) < p.quota or usable_own < len(new), (trial, len(own), usable_own, len(new))
    assert named > 50  # the batch answered in most trials


class _CountingReader(_MarkingReader):
    """Records each submit_each call as the first range offsets of its batches."""

    def __init__(self):
        self.calls: list[list[int]] = []

    def submit_each(self, batches):
        self.calls.append([b[0][0].offset for b in batches])
        return super().submit_each(batches)


def test_a_layers_misses_go_to_the_reader_in_one_call():
    """acquire queues its missed experts with one reader call (the direct reader then checks the file once per layer,
    not once per expert), one batch per miss in the order asked, none for the hits."""
    store = _marked_store(LAYERS * TOP_K)
    reader = store.reader = _CountingReader()
    batch = store.acquire(0, [1, 2, 3, 5])
    batch.wait_all()
    store.release(0)
    assert reader.calls == [[(0 * EXPERTS + e) * 64 for e in (1, 2, 3, 5)]]
    batch = store.acquire(0, [2, 4, 5, 9])  # 2 and 5 are hits
    batch.wait_all()
    for j, e in enumerate([2, 4, 5, 9]):
        assert bool((batch.gate_up[batch.slots[j]] == e % 251).all()), e
    store.release(0)
    assert reader.calls[1:] == [[4 * 64, 9 * 64]]
    store.acquire(0, [2, 4, 5, 9]).wait_all()  # all hits: no call
    assert len(reader.calls) == 2


@pytest.mark.parametrize("slots", [TOP_K + 2, LAYERS * TOP_K // 2, LAYERS * TOP_K + 5])
def test_native_table_gives_the_python_policys_store(slots):
    """The default store (FairShareLFU in slots.c) and one over store/policy.py's FairShareLFU in Python, driven by
    the same decode with guesses (good and poor ones, some prompt read-ahead): the same slot for every expert, the
    same counters (not the time they took)."""
    from sluice.store.policy import FairShareLFU
    from sluice.store.slot_table import NativeSlots, PolicySlots

    c = _store(slots)
    py = _store(slots, FairShareLFU(list(range(LAYERS)), EXPERTS, TOP_K, slots))
    if not isinstance(c.table, NativeSlots):
        pytest.skip("slots.c is not built (no C compiler at install): both stores would be Python's")
    assert isinstance(py.table, PolicySlots)
    rng = random.Random(slots)
    favourites = [e for e in range(EXPERTS) for _ in range(1 + e % 3)]
    for token in range(60):
        for layer in range(LAYERS):
            ids = list(dict.fromkeys(rng.sample(favourites, len(favourites))))[:TOP_K]
            guess = ids if rng.random() < 0.7 else rng.sample(range(EXPERTS), TOP_K)
            if layer + 1 < LAYERS:
                for s in (c, py):
                    s.prefetch_next(layer + 1, guess if token % 5 else list(range(EXPERTS)))
            batches = [s.acquire(layer, ids) for s in (c, py)]
            assert batches[0].slots == batches[1].slots, (token, layer)
            if token % 7 == 0 and layer + 1 < LAYERS:
                for s in (c, py):
                    s.prefetch(layer + 1, list(range(EXPERTS)), prompt=True)
            for s in (c, py):
                s.release(layer)
    timed = ("io_wait_s",)
    assert {k: v for k, v in c.stats().items() if k not in timed} == {k: v for k, v in py.stats().items()
                                                                       if k not in timed}
    assert c.stats()["evictions"] > 0 and c.stats()["prefetch_issued"] > 0
    assert [c.table.owner(s) for s in range(slots)] == [py.table.owner(s) for s in range(slots)]
