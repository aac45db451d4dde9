"""Placed slots (store/streaming.py _page_shifts): each layer's experts sit in their slots at their file offsets
modulo the files' O_DIRECT alignment (512 to 4096 bytes, probed per file: io/odirect.py odirect_align), so O_DIRECT
moves their whole blocks straight into the slots. Results stay bitwise the resident run's; the memory stays within
the budget (fewer slots, not more bytes); only partial blocks are copied."""

from __future__ import annotations

import pytest
import torch

import sluice
from sluice.io.ranges import PAGE
from sluice.store import streaming
from sluice.store.pages import page_rows
from tests.checkpoint.gguf_files import GGUF_TINY, Q, convert
from tests.models.tiny import hf_model, write_checkpoint

IDS = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(3)).tolist()
LONG = torch.randint(0, 300, (160,), generator=torch.Generator().manual_seed(4)).tolist()
SHAPES = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256, head_dim=64)  # whole K blocks


def _plain(name: str) -> bool:
    return name.endswith(("norm.weight", "ffn_gate_inp.weight", ".bias"))


FILES = {  # a GGUF's stacked experts (one residue per layer), and per-expert safetensors (a residue per tensor)
    "gguf-bf16": lambda n: Q.F32 if _plain(n) else Q.BF16,
    "gguf-q4_k-q6_k": lambda n: Q.F32 if _plain(n) else Q.Q6_K if n.startswith("blk.0.ffn_down") else Q.Q4_K,
    "safetensors": None,
}


@pytest.fixture(scope="module", params=list(FILES))
def model(request, tmp_path_factory):
    """(name in FILES, path)"""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "safetensors":
        return request.param, write_checkpoint(hf_model("qwen3_moe", torch.bfloat16, **SHAPES), root, "per_expert")
    model = hf_model("qwen3_moe", **{**GGUF_TINY["qwen3_moe"], **SHAPES})
    return request.param, convert(model, root / "m.gguf", qtype=FILES[request.param])


@pytest.mark.parametrize("cache", ["min", "half"])
def test_page_aligned_slots_are_exact_and_within_budget(model, monkeypatch, cache):
    name, model_path = model
    with sluice.load(model_path, memory="all") as m:
        want = m.logits(LONG), m.logits(IDS)
        tokens = list(m.generate_tokens(IDS, max_tokens=6, stop_at_eos=False))
        resident, spec, layout = m.resident_bytes, m.spec, m.layout
    slots = spec.top_k + 1 if cache == "min" else layout.total_experts // 2
    monkeypatch.setattr(streaming, "PLACED_MAX_COST", 1e9)  # these slots are KiBs: place them anyway
    with sluice.load(model_path, memory=resident + slots * layout.expert_nbytes, io="direct", odirect=True) as m:
        got = m.logits(LONG), m.logits(IDS)
        assert list(m.generate_tokens(IDS, max_tokens=6, stop_at_eos=False)) == tokens
        store, st = m.store, m.reader.stats()
        align = m.reader.alignment([m.layout.parts(m.layout.layers[0], 0)[0].range.path]) or PAGE
        assert any(store._shift.values()) and store.raw.shape[1] % PAGE == 0 and store.raw.data_ptr() % PAGE == 0
        assert store.nbytes <= slots * layout.expert_nbytes  # the pages of room cost slots, not memory
        assert spec.top_k <= store.n_slots < slots
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # bitwise
    if st["odirect_fallback"]:
        pytest.skip("this filesystem refuses O_DIRECT")
    # measured at 4096: 3% of the bytes (bf16 GGUF, 128 KiB parts: the partial pages at their ends), 16-25% (Q4_K's
    # 36 KiB parts, and layer 0's Q6_K down projections, 52.5 KiB an expert: at a new residue each, all staged), 3%
    # (per-expert safetensors: the residue most of a layer's tensors share); at 512 (this VM's disk) 0.4%, 1.1-1.3%
    # (every expert of a tensor at one residue) and 0.4%
    share = {"gguf-bf16": 0.1, "gguf-q4_k-q6_k": 0.35, "safetensors": 0.1}[name] if align == PAGE else 0.03
    assert st["copied_bytes"] < share * st["bytes_read"]


def test_a_budget_for_every_expert_keeps_every_expert(model, monkeypatch):
    """Placed slots take a block and a page more each; a budget with room for that still holds every expert (no misses
    after the first read of each), and one without gives up only the slots those pages take."""
    model_path = model[1]
    with sluice.load(model_path, memory="all") as m:
        resident, layout = m.resident_bytes, m.layout
    monkeypatch.setattr(streaming, "PLACED_MAX_COST", 1e9)
    total = layout.total_experts
    with sluice.load(model_path, memory=resident + 2 * total * layout.expert_nbytes, io="direct", odirect=True) as m:
        assert any(m.store._shift.values()) and m.store.n_slots == total
    with sluice.load(model_path, memory=resident + total * layout.expert_nbytes, io="direct", odirect=True) as m:
        stride = m.store.raw.shape[1]
        assert m.store.n_slots == total * layout.expert_nbytes // stride < total
        assert m.store.nbytes <= total * layout.expert_nbytes


@pytest.mark.parametrize("odirect,smallest", [(True, "no cost allowed"), (False, "0")])
def test_stored_layout_below_the_size_or_without_odirect(model, monkeypatch, odirect, smallest):
    """Auto: slots that placing would cost more than PLACED_MAX_COST of, or a reader without O_DIRECT, keep the
    stored layout and the budget's full slot count."""
    model_path = model[1]
    with sluice.load(model_path, memory="all") as m:
        resident, layout, k = m.resident_bytes, m.layout, m.spec.top_k
    monkeypatch.setattr(streaming, "PLACED_MAX_COST", -1 if smallest != "0" else 1e9)
    with sluice.load(model_path, memory=resident + (k + 2) * layout.expert_nbytes, io="direct", odirect=odirect) as m:
        assert not m.store._shift and m.store.n_slots == k + 2
        assert m.store.raw.shape[1] == layout.expert_nbytes


def test_slot_rows_without_huge_pages(monkeypatch):
    """Where mmap has no MADV_HUGEPAGE (no THP, not Linux) the slots are the same zeroed, page-aligned rows in 4 KiB
    pages."""
    import mmap

    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    rows = page_rows(3, 2 * PAGE)
    assert rows.shape == (3, 2 * PAGE) and rows.data_ptr() % PAGE == 0 and not rows.any()
    assert page_rows(0, PAGE).shape == (0, PAGE)


@pytest.mark.parametrize("engine", ["native", "uring", "python"])
def test_each_expert_is_planned_once(model, engine):
    """The native reader (its threads, or its io_uring) plans a missed expert's reads once (io/direct.py
    ReadTemplate) and reads it again into whichever slot it gets; the Python reader plans every time. All give the
    resident run's bits."""
    from sluice.io import native_pool

    if engine != "python" and not native_pool.available():
        pytest.skip("the native reader (io/preader.c) is not built")
    if engine == "uring" and (why := native_pool.uring_error()):
        pytest.skip(why)
    model_path = model[1]
    with sluice.load(model_path, memory="all") as m:
        want = m.logits(LONG), m.logits(IDS)
        resident, spec, layout = m.resident_bytes, m.spec, m.layout
    memory = resident + (spec.top_k + 1) * layout.expert_nbytes  # the smallest cache: experts come back often
    with sluice.load(model_path, memory=memory, io="direct", odirect=True, io_engine=engine) as m:
        got = m.logits(LONG), m.logits(IDS)
        store = m.store
        if engine == "python":
            assert store._templates is None
        else:  # far more misses than experts planned: the templates were read again, into other slots
            assert 0 < len(store._templates) <= layout.total_experts < store.misses
    assert all(torch.equal(a, b) for a, b in zip(got, want))
