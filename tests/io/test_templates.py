"""Read templates (io/direct.py ReadTemplate): a batch planned once and submitted again into destinations at another
base address, as the streaming store reads a missed expert into whichever slot is free. The same bytes, counters and
journal as submit_each; the same errors."""

from __future__ import annotations

import os

import pytest

from sluice.errors import CheckpointError
from sluice.io import DirectReader, native_pool
from sluice.io.ranges import PAGE, ReadRange, address

pytestmark = pytest.mark.skipif(not native_pool.available(), reason="the native reader (io/preader.c) is not built")

SIZE = 64 * PAGE + 1234
SLOT = 16 * PAGE


@pytest.fixture
def slots(page_buffer):
    """Four page-aligned slots of SLOT bytes, back to back."""
    return page_buffer(4 * SLOT)


def _requests(path: str, slot: memoryview) -> list:
    """An expert-like batch: three ranges far apart in the file, each to its place in one slot (one of them at the
    file's residue, one not, one ending at EOF), plus a duplicate of the first."""
    ranges = [(1184, 3 * PAGE), (20 * PAGE + 96, 2 * PAGE + 10), (SIZE - 2 * PAGE - 100, 2 * PAGE + 100)]
    at = [1184, 4 * PAGE, 7 * PAGE]
    reqs = [(ReadRange(path, o, n), slot[a : a + n]) for (o, n), a in zip(ranges, at)]
    return reqs + [(reqs[0][0], slot[12 * PAGE + 64 : 15 * PAGE + 64])]


@pytest.mark.parametrize("odirect", [True, False])
def test_template_reads_into_any_base(random_file, slots, odirect, io_engine):
    if io_engine == "python":
        pytest.skip("the Python threads plan every batch (test_python_threads_plan_every_time)")
    path, data = random_file(SIZE, 11)
    base = address(slots)
    with DirectReader(4, odirect=odirect, engine=io_engine) as r:
        t = r.template(_requests(path, slots[:SLOT]), base)
        r.journal(journal := [])
        futs = r.submit_templates([(t, base + k * SLOT) for k in (2, 1, 3)])
        for f in futs:
            f.result()
        st = r.stats()
    for k in (1, 2, 3):
        for rng, dest in _requests(path, slots[k * SLOT : (k + 1) * SLOT]):
            assert bytes(dest) == data[rng.offset : rng.end], (k, rng)
    assert bytes(slots[:SLOT]) == bytes(SLOT)  # the base it was planned at is never written
    with DirectReader(4, odirect=odirect) as ref:  # the same three batches through submit_each
        ref.journal(want := [])
        for f in ref.submit_each([_requests(path, slots[k * SLOT : (k + 1) * SLOT]) for k in (2, 1, 3)]):
            f.result()
        want_st = ref.stats()
    assert journal == want
    for key in ("batches", "requests", "bytes_requested", "bytes_read", "reads", "coalesced", "dedup_saved_bytes"):
        assert st[key] == want_st[key], key


def test_python_threads_plan_every_time(random_file, slots):
    path, _ = random_file(SIZE, 12)
    with DirectReader(2, engine="python") as r:
        assert r.template(_requests(path, slots[:SLOT]), address(slots)) is None


def test_a_changed_or_truncated_file_is_a_checkpoint_error(random_file, slots, io_engine):
    if io_engine == "python":
        pytest.skip("the Python threads plan every batch: no templates")
    path, _ = random_file(SIZE, 13)
    base = address(slots)
    with DirectReader(2, odirect=True, engine=io_engine) as r:
        t = r.template(_requests(path, slots[:SLOT]), base)
        os.truncate(path, 30 * PAGE)  # the third range now lies past the end
        (f,) = r.submit_templates([(t, base + SLOT)])
        with pytest.raises(CheckpointError, match="model.bin"):
            f.result()


def _python_plan(requests, fds, *, max_gap, max_read, parts):
    """What DirectReader planned in Python before plan.c: plan_reads, split_even, _ops (destination addresses)."""
    from sluice.io.ranges import plan_reads, split_even

    plan = plan_reads(requests, max_gap=max_gap, max_read=max_read, parts=parts)
    ops, ends, dests = [], [], []
    native_pool._ops(split_even(plan.reads, parts), fds, ops, ends, dests)
    return ops, ends, dests, plan.counts, tuple(plan.paths())


@pytest.mark.parametrize("seed", range(40))
def test_the_native_planner_plans_as_plan_reads(seed, monkeypatch):
    """plan.c against plan_reads + split_even + _ops on random batches: duplicates, overlaps, neighbours within and
    beyond max_gap, ranges cut at max_read, zero-length requests, several files (sorted by name, not by order of
    appearance), 1-8 parts, a small MAX_SEGMENTS: the same op list, chunk ends, destination positions, counters."""
    import random

    from sluice.io import ranges as ranges_mod

    rng = random.Random(seed)
    max_segments = rng.choice([3, 500])
    monkeypatch.setattr(ranges_mod, "MAX_SEGMENTS", max_segments)
    min_split = rng.choice([PAGE, 4 * PAGE, ranges_mod.MIN_SPLIT])
    monkeypatch.setattr(ranges_mod, "MIN_SPLIT", min_split)
    paths = ["/m/b.gguf", "/m/a.gguf", "/m/c-00002.gguf"][: rng.randint(1, 3)]
    fds = {p: (10 + i, rng.choice([0, 512, 4096])) for i, p in enumerate(paths)}
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    requests, at = [], 0
    for _ in range(rng.randint(0, 30)):
        if requests and rng.random() < 0.15:  # a duplicate range into another destination
            r = rng.choice(requests)[0]
        else:
            n = rng.choice([0, rng.randint(1, 300), rng.randint(1, 3 * PAGE), rng.randint(1, 40 * PAGE)])
            r = ReadRange(rng.choice(paths), rng.randint(0, 200 * PAGE), n)
        if at + r.nbytes > len(buf):
            break
        requests.append((r, view[at : at + r.nbytes]))
        at += r.nbytes + rng.choice([0, 7, 64])
    max_gap = rng.choice([0, 100, PAGE, 16 * PAGE])
    max_read = rng.choice([PAGE, 8 * PAGE, 1 << 20, 8 << 20])
    parts = rng.randint(1, 8)
    want = _python_plan(requests, fds, max_gap=max_gap, max_read=max_read, parts=parts)
    (got,) = native_pool.plan_many([[(r.path, r.offset, r.nbytes, address(d) if r.nbytes else 0)
                                     for r, d in requests]], {p: fds[p] for p in {r.path for r, _ in requests
                                                                                 if r.nbytes}},
                                   max_gap=max_gap, max_read=max_read, parts=parts, min_split=min_split,
                                   max_segments=max_segments)
    assert got[0].tolist() == want[0]
    assert got[1].tolist() == want[1]
    assert got[2].tolist() == want[2]
    assert got[3] == want[3]
    assert got[4] == want[4]


def test_the_native_planner_refuses_a_negative_range():
    with pytest.raises(ValueError, match="offset and nbytes must be >= 0"):
        native_pool.plan_many([[("/m/a", -1, 10, 0)]], {"/m/a": (3, 0)}, max_gap=0, max_read=1 << 20, parts=2,
                              min_split=1 << 20, max_segments=500)


def test_a_layer_of_templates_in_one_call_is_each_one_planned_alone(random_file, io_engine):
    """templates_at (one C call for many batches: a streaming store's layer) against template_at batch by batch,
    on expert-like batches at varied residues, some crossing a max_read boundary, one with a zero-length part."""
    if io_engine == "python":
        pytest.skip("the Python threads plan every batch: no templates")
    import random

    path, _ = random_file(SIZE, 14)
    rng = random.Random(3)
    batches = []
    for e in range(40):
        parts = [(ReadRange(path, rng.randrange(0, SIZE - 3 * PAGE), rng.choice([0, 100, PAGE + 7, 3 * PAGE])),
                  rng.randrange(0, 8) * 512) for _ in range(3)]
        batches.append(parts)
    with DirectReader(4, odirect=True, engine=io_engine, max_read=2 * PAGE) as r:
        many = r.templates_at(batches)
        for b, t in zip(batches, many, strict=True):
            one = r.template_at(b)
            assert t.ops.tolist() == one.ops.tolist()
            assert t.ends.tolist() == one.ends.tolist() and t.dests.tolist() == one.dests.tolist()
            assert (t.counts, t.paths) == (one.counts, one.paths)
            assert t.desc[2:] == one.desc[2:]
            if len(t.ops):  # where its reads' ops are: in the layer's one array
                assert t.desc[0] == t.ops.ctypes.data
