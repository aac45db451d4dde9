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
