"""The streaming store's decode path in C (store/stream_native.py, stream.c) against its Python path: the same
placements, evictions, reads and counters on the same calls, the bytes in the slots the same; a guessed read that
failed raises at use; a journal, a prompt's read-ahead and a loan take the Python path, with the C path's reads landed
first."""

from __future__ import annotations

import random

import pytest
import torch

import sluice
from sluice.errors import CheckpointError
from sluice.io.ranges import ReadRange
from sluice.store import stream_native
from sluice.store.stream_native import NativeStream

from ..models.tiny import hf_model, write_checkpoint

pytestmark = pytest.mark.skipif(not stream_native.available(),
                                reason="sluice/store/stream.c is not built (setup.py build_ext)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(hf_model("qwen3_moe", torch.bfloat16), tmp_path_factory.mktemp("qwen3_moe"), "per_expert")


def _load(model_dir, slots_over_top_k: int = 4, odirect: bool = True):
    with sluice.load(model_dir) as m:
        resident, expert, k = m.resident_bytes, m.layout.expert_nbytes, m.spec.top_k
    return sluice.load(model_dir, memory=resident + (k + slots_over_top_k) * expert, io="direct", odirect=odirect)


def _never(*_a, **_k):
    raise AssertionError("the Python path queued a read")


def _drive(store, calls) -> list:
    """Run the calls (("prefetch", L, ids) or ("acquire", L, ids)) and return what each acquire saw: its slots and
    the bytes of each slot once its read landed."""
    seen = []
    for kind, L, ids in calls:
        if kind == "prefetch":
            store.prefetch(L, ids)
            continue
        batch = store.acquire(L, ids)
        batch.wait_all()
        seen.append((batch.slots, [bytes(store.raw[s].numpy()) for s in batch.slots]))
        store.release(L)
    return seen


@pytest.mark.parametrize("odirect", [True, False], ids=["odirect", "buffered"])
def test_same_choices_reads_and_bytes_as_the_python_path(model_dir, odirect):
    rng = random.Random(7)
    with _load(model_dir, odirect=odirect) as a, _load(model_dir, odirect=odirect) as b:
        s = a.spec
        layers = a.layout.layers
        calls = []
        for _ in range(120):  # a guess (right, half right or wrong) then the true acquire of a layer
            L = rng.choice(layers)
            ids = sorted(rng.sample(range(s.num_experts), s.top_k))
            guess = sorted(rng.sample(ids, s.top_k // 2) + rng.sample(range(s.num_experts), s.top_k // 2))
            calls += [("prefetch", L, guess), ("acquire", L, ids)]
        b.store._stream = False  # Python's path
        a.store._submit = _never  # C's: no read queued from Python
        got_a, got_b = _drive(a.store, calls), _drive(b.store, calls)
        assert isinstance(a.store._stream, NativeStream)
        assert got_a == got_b
        sa, sb = a.store.stats(), b.store.stats()
        sa.pop("io_wait_s"), sb.pop("io_wait_s")
        assert sa == sb and sa["misses"] > 0 and sa["prefetch_issued"] > 0 and sa["evictions"] > 0
        ra, rb = a.store.reader.stats(), b.store.reader.stats()
        for k in ("batches", "requests", "bytes_requested", "bytes_read", "reads", "coalesced"):
            assert ra[k] == rb[k], k
        assert sorted(a.store.table) == sorted(b.store.table)
        assert torch.equal(a.store.usage, b.store.usage)


def test_decode_runs_the_c_path_and_gives_the_python_paths_tokens(model_dir):
    ids = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    with _load(model_dir) as a, _load(model_dir) as b:
        b.store._stream = False
        ta = list(a.generate_tokens(ids, max_tokens=10, stop_at_eos=False))
        assert isinstance(a.store._stream, NativeStream)
        tb = list(b.generate_tokens(ids, max_tokens=10, stop_at_eos=False))
        assert ta == tb
        assert a.stats()["prefetch_issued"] == b.stats()["prefetch_issued"] > 0


def test_a_failed_guessed_read_raises_at_use_and_the_batch_is_forgotten(model_dir):
    with _load(model_dir, odirect=False) as m:
        store = m.store
        L, k = m.layout.layers[0], m.spec.top_k
        store.acquire(L, list(range(k)))  # the C path made, every expert planned
        store.release(L)
        stream = store._stream
        assert isinstance(stream, NativeStream)
        e = next(e for e in range(m.spec.num_experts) if (L, e) not in store.table)
        path = m.layout.parts(L, e)[0].range.path
        size = __import__("os").path.getsize(path)
        bad = store.reader.template_at([(ReadRange(path, size + 4096, 4096), 0)])  # past the end of the file
        store._templates[(L, e)] = bad
        stream._tmpl[L * stream.E + e] = bad.desc
        stream._counts[L * stream.E + e] = bad.counts
        store.prefetch(L, [e])
        assert stream.pending((L, e)) and not store._pending
        ids = sorted({e, *[x for x in range(m.spec.num_experts) if x != e][: k - 1]})
        batch = store.acquire(L, ids)
        with pytest.raises(CheckpointError, match="short read"):
            batch.wait_all()
        store.release(L)
        assert (L, e) not in store.table and not stream.pending((L, e))


def test_journal_prompt_read_ahead_and_loan_take_the_python_path(model_dir):
    with _load(model_dir, slots_over_top_k=8) as m:
        store, s = m.store, m.spec
        L = m.layout.layers[0]
        store.acquire(L, list(range(s.top_k)))
        store.release(L)
        stream = store._stream
        free = [e for e in range(s.num_experts) if (L, e) not in store.table]
        store.prefetch(L, free[:2])  # kept in C
        assert stream.pending((L, free[0])) and store._streamed
        journal: list = []
        store.reader.journal(journal)
        store.prefetch(L, free[2:4])  # a journal: Python's path, C's guessed reads landed first
        assert journal and not store._streamed and not stream.pending((L, free[0]))
        assert (L, free[2]) in store._pending
        store.reader.journal(None)
        store.prefetch(L, free[4:6], prompt=True)  # a prompt's read-ahead: Python's
        for fut in list(store._pending.values()):
            fut.result()
        batch = store.acquire(L, sorted(free[:2] + free[4:4 + s.top_k - 2]))  # landed ones forgotten: C's path
        batch.wait_all()
        store.release(L)
        assert not store._pending
        L2 = m.layout.layers[-1]
        store.prefetch(L2, [e for e in range(s.num_experts) if (L2, e) not in store.table][:2])
        assert store._streamed
        assert store.lend(store.raw.shape[1], keep=s.top_k) > 0  # a loan lands C's reads first
        assert not store._streamed
        store.lend_back()


def test_a_file_changed_under_the_c_path_fails_its_reads_naming_the_file(model_dir, tmp_path):
    import os
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(model_dir, folder)
    with _load(folder, odirect=False) as m:
        store, s = m.store, m.spec
        L = m.layout.layers[0]
        store.acquire(L, list(range(s.top_k)))  # the C path made
        store.release(L)
        assert isinstance(store._stream, NativeStream)
        shard = m.index.files[0]
        os.truncate(shard, os.path.getsize(shard) - 1)
        ids = sorted(e for e in range(s.num_experts) if (L, e) not in store.table)[: s.top_k]
        with pytest.raises(CheckpointError) as e:  # an acquire whose misses the C path queued: the check after
            store.acquire(L, ids).wait_all()
        assert shard.name in str(e.value) and "truncated" in str(e.value)
        assert all((L, x) not in store.table for x in ids)  # the batch is forgotten
        store.release(L)
        L2 = m.layout.layers[-1]
        store.prefetch(L2, [e for e in range(s.num_experts) if (L2, e) not in store.table][:2])  # Python's path
        assert not store._streamed
