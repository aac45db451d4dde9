"""slots.c (NativeSlots) makes FairShareLFU's choices: the same random sequences of acquires, guesses, drops and loans
through it and through PolicySlots over store/policy.py's FairShareLFU give the same slot, the same victims and the
same state after every call."""

from __future__ import annotations

import random

import numpy as np
import pytest

from sluice.store.policy import FairShareLFU
from sluice.store.slot_table import NativeSlots, PolicySlots, native_available

pytestmark = pytest.mark.skipif(not native_available(), reason="slots.c is not built (no C compiler at install)")


def _pair(layers, n_layers, experts, top_k, slots):
    return (PolicySlots(FairShareLFU(layers, experts, top_k, slots), slots),
            NativeSlots(layers, n_layers, experts, top_k, slots))


def _state(t, slots):
    return (list(t), t.free, sorted(t.pinned), [t.owner(s) for s in range(slots)], len(t))


def _same(a, b, call, *args):
    ra, rb = getattr(a, call)(*args), getattr(b, call)(*args)
    assert ra == rb, (call, args)
    return ra


@pytest.mark.parametrize("seed", range(6))
def test_random_sequences_match_the_python_policy(seed):
    rng = random.Random(seed)
    layers, n_layers, experts, top_k = [1, 2, 4, 5, 6], 7, 16, 4  # layers 0 and 3 dense
    slots = rng.choice([top_k + 1, 9, 14, 23, 40, 80])  # under one token's working set, and over it
    py, c = _pair(layers, n_layers, experts, top_k, slots)
    assert py.quota == c.quota
    rows_py, rows_c = np.zeros((n_layers, experts), dtype=np.int64), np.zeros((n_layers, experts), dtype=np.int64)
    py.count_into(rows_py)
    c.count_into(rows_c)
    skewed = [e for e in range(experts) for _ in range(1 + (e % 4) ** 2)]  # favourites: use counts differ
    for step in range(600):
        kind, layer = rng.random(), rng.choice(layers)
        if kind < 0.05 and len(py):  # a failed batch's entry dropped, its slot freed
            key = rng.choice(list(py))
            slot = _same(py, c, "remove", key)
            _same(py, c, "push_free", slot)
        elif kind < 0.08:  # a prompt's loan: the last slots emptied, the free list cut; then given back
            first = rng.randrange(top_k, slots + 1)
            for s in range(first, slots):
                if (key := py.owner(s)) is not None:
                    _same(py, c, "remove", key)
            for t in (py, c):
                t.set_free([s for s in t.free if s < first])
            assert _state(py, slots) == _state(c, slots)
            for t in (py, c):
                t.set_free(list(range(slots - 1, first - 1, -1)) + t.free)
        else:
            room = slots - len(py.pinned)
            if room < 1:
                py.unpin_all(), c.unpin_all()
                room = slots
            n = rng.randint(1, min(top_k, room))
            ids = (rng.sample(range(experts), n) if rng.random() < 0.5
                   else (list(dict.fromkeys(rng.sample(skewed, len(skewed)))))[:n])
            _, missed, _ = _same(py, c, "acquire", layer, ids)
            py.used(layer, ids, list(missed))  # a copy: not the acquire's own list
            c.used(layer, ids, missed)
            if rng.random() < 0.6:  # a guess for another layer, this acquire still pinned (none placed when full)
                guess = [rng.choice(skewed) for _ in range(rng.randint(1, 2 * top_k))]
                _same(py, c, "prefetch", rng.choice(layers), guess)
            if rng.random() < 0.8:  # release
                py.unpin_all(), c.unpin_all()
        assert _state(py, slots) == _state(c, slots), step
    assert np.array_equal(rows_py, rows_c)
    assert len(py) > 0


def test_decayed_counts_rescale_as_python_does():
    """72,000 acquires of one layer pass the 1e200 increment (0.99 ** -46,000) and where it would overflow (~70,600):
    both rescale, the same victims all along."""
    py, c = _pair([0], 1, 4, 1, 2)
    rng = random.Random(0)
    rows = np.zeros((2, 1, 4), dtype=np.int64)
    py.count_into(rows[0])
    c.count_into(rows[1])
    for _ in range(72_000):
        ids = [rng.choice([0, 0, 0, 1, 2, 3])]
        _, missed, _ = _same(py, c, "acquire", 0, ids)
        py.used(0, ids, missed)
        c.used(0, ids, list(missed))
        py.unpin_all(), c.unpin_all()
    assert py.policy._increment[0] < 1e200  # rescaled
    assert _state(py, 2) == _state(c, 2)
    assert np.array_equal(rows[0], rows[1])


def test_bad_calls_are_clean_errors():
    _, c = _pair([0, 1], 2, 8, 2, 4)
    with pytest.raises(ValueError, match="repeat or are out of range"):
        c.acquire(0, [1, 1])
    with pytest.raises(ValueError, match="repeat or are out of range"):
        c.acquire(0, [8])
    with pytest.raises(ValueError, match="out of range"):
        c.prefetch(1, [-1])
    assert len(c) == 0 and not c.pinned  # nothing changed
    c.acquire(0, [1, 2, 3, 4])
    with pytest.raises(RuntimeError, match="no unpinned slot"):  # every slot pinned
        c.acquire(1, [0])
    with pytest.raises(KeyError):
        c.remove((1, 5))
    with pytest.raises(ValueError, match="holding an expert"):
        c.set_free([0])
    with pytest.raises(ValueError, match="holding an expert or free already"):
        c.push_free(0)
    with pytest.raises(ValueError, match="usage counts"):
        c.count_into(np.zeros((2, 8), dtype=np.int32))


def test_the_table_a_store_gets(monkeypatch):
    """make_table: a given policy runs in Python; else FairShareLFU in C, or in Python where slots.c is not built."""
    from sluice.store import slot_table
    from sluice.store.policy import GlobalLRU

    assert isinstance(slot_table.make_table([0, 1], 2, 8, 2, 6, GlobalLRU()), PolicySlots)
    assert isinstance(slot_table.make_table([0, 1], 2, 8, 2, 6), NativeSlots)
    monkeypatch.setattr(slot_table, "LIB", None)
    t = slot_table.make_table([0, 1], 2, 8, 2, 6)
    assert isinstance(t, PolicySlots) and isinstance(t.policy, FairShareLFU) and t.quota == 2
