"""A prompt's read-ahead (LoadOptions.prompt_prefetch, models/blocks.py): while a chunk runs layer L's experts, the
next MoE layer's likely experts are read into the slots left free. Output is bitwise unchanged; the reads replace
misses of the next layer (a long prompt touches nearly every expert, so few are wasted); decode's prefetch counters
and throttle do not see them."""

from __future__ import annotations

import pytest
import torch

import sluice
from sluice.store import streaming

from ..models.tiny import hf_model, write_checkpoint

LONG = torch.randint(0, 300, (160,), generator=torch.Generator().manual_seed(21)).tolist()


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def model_dir(request, tmp_path_factory):
    return write_checkpoint(hf_model(request.param, torch.bfloat16), tmp_path_factory.mktemp(request.param),
                            "per_expert")


@pytest.mark.parametrize("io", ["willneed", "direct"])
def test_prompt_read_ahead_is_exact_and_replaces_misses(model_dir, io):
    with sluice.load(model_dir, memory="all") as m:
        want = m.logits(LONG)
        resident, layout, spec = m.resident_bytes, m.layout, m.spec
    per_layer = spec.num_experts
    memory = resident + (per_layer + per_layer // 2) * layout.expert_nbytes  # one layer and half the next
    runs = {}
    for on in (False, True):
        with sluice.load(model_dir, memory=memory, io=io, prompt_prefetch=on) as m:
            assert torch.equal(m.logits(LONG), want)
            runs[on] = m.stats()
    off, st = runs[False], runs[True]
    assert off["prompt_prefetch_issued"] == 0
    assert st["prompt_prefetch_issued"] > 0 and st["prefetch_issued"] == 0  # decode's counters untouched
    assert st["prompt_prefetch_used"] >= 0.8 * st["prompt_prefetch_issued"]
    assert st["misses"] <= off["misses"] - st["prompt_prefetch_used"]  # each used read-ahead was a miss before
    assert st["bytes_read"] == (st["misses"] + st["prompt_prefetch_issued"]) * layout.expert_nbytes


def test_no_read_ahead_on_the_mmap_reader(model_dir):
    """The mmap reader copies at submit, in the caller: a read-ahead there would stall the layer's math."""
    with sluice.load(model_dir, memory="all") as m:
        want = m.logits(LONG)
        resident, layout, spec = m.resident_bytes, m.layout, m.spec
    with sluice.load(model_dir, memory=resident + 2 * spec.num_experts * layout.expert_nbytes, io="mmap") as m:
        assert torch.equal(m.logits(LONG), want)
        assert m.stats()["prompt_prefetch_issued"] == 0


@pytest.mark.parametrize("group", [1, 2])
def test_a_read_ahead_whose_reader_fails_midway_keeps_the_cache_true(model_dir, group, monkeypatch):
    """The reader raises on the third read batch of a read-ahead (`group` experts each: PROMPT_READ_GROUP): the
    experts of the two submitted stay cached with their reads pending (an acquire waits for them), the rest leave
    the cache with their slots freed, and the output stays exact."""
    monkeypatch.setattr(streaming, "PROMPT_READ_GROUP", group)
    with sluice.load(model_dir, memory="all") as m:
        want = m.logits(LONG)
        resident, layout, spec = m.resident_bytes, m.layout, m.spec
    memory = resident + 3 * spec.num_experts * layout.expert_nbytes
    with sluice.load(model_dir, memory=memory, io="direct") as m:
        store, submit, calls = m.store, m.reader.submit, []

        def failing(requests):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("reader closed")
            return submit(requests)

        layer = store.layout.layers[-1]
        m.reader.submit = failing
        with pytest.raises(RuntimeError, match="reader closed"):
            store.prefetch(layer, list(range(spec.num_experts)), prompt=True)
        m.reader.submit = submit
        placed = [(layer, e) for e in range(spec.num_experts) if (layer, e) in store.table]
        assert len(placed) == 2 * group and all(k in store._pending for k in placed)
        assert len(store.table.free) + len(store.table) == store.n_slots
        assert torch.equal(m.logits(LONG), want)


def test_a_read_ahead_submits_a_few_experts_per_batch(model_dir):
    """A prompt's read-ahead hands the reader PROMPT_READ_GROUP experts per batch in expert order, whatever the
    prediction's order (neighbours in a stacked tensor coalesce; a batch's planning and hand-off are paid once), and
    every expert of a batch waits on its future."""
    with sluice.load(model_dir, memory="all") as m:
        want = m.logits(LONG)
        resident, layout, spec = m.resident_bytes, m.layout, m.spec
    with sluice.load(model_dir, memory=resident + 3 * spec.num_experts * layout.expert_nbytes, io="direct") as m:
        store, submit, sizes = m.store, m.reader.submit, []
        m.reader.submit = lambda requests: (sizes.append(len(requests)), submit(requests))[1]
        layer = store.layout.layers[-1]
        store.prefetch(layer, list(range(spec.num_experts))[::-1], prompt=True)  # the prediction's order: any
        m.reader.submit = submit
        group = streaming.PROMPT_READ_GROUP
        per = len(store._requests(layer, 0, 0))  # reads of one expert
        assert len(sizes) == -(-spec.num_experts // group) and sizes[0] == min(group, spec.num_experts) * per
        futures = [store._pending[(layer, e)] for e in range(spec.num_experts)]
        assert all(futures[e] is futures[e - e % group] for e in range(spec.num_experts))
        assert torch.equal(m.logits(LONG), want)
