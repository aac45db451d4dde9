"""Streamed experts give exactly the resident run's logits and tokens, for every reader and cache size."""

from __future__ import annotations

import os

import pytest
import torch

import sluice
from sluice.errors import BudgetError, CheckpointError

from ..models.tiny import hf_model, write_checkpoint

IDS = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module", params=[("qwen3_moe", "per_expert"), ("mixtral", "fused"), ("glm4_moe", "per_expert"),
                                        ("deepseek_v3", "fused")],
                ids=lambda p: p[0])
def model_dir(request, tmp_path_factory):
    arch, layout = request.param
    folder = tmp_path_factory.mktemp(arch)
    return write_checkpoint(hf_model(arch, torch.bfloat16), folder, layout)


@pytest.fixture(scope="module")
def reference(model_dir):
    with sluice.load(model_dir) as m:
        logits = m.logits(IDS)
        tokens = list(m.generate_tokens(IDS, max_tokens=8, stop_at_eos=False))
        return logits, tokens, m.resident_bytes, m.layout.expert_nbytes, m.spec


def _memory_for(reference, slots: int) -> int:
    _, _, resident, expert, _ = reference
    return resident + slots * expert


@pytest.mark.parametrize("io,odirect", [("mmap", False), ("willneed", False), ("direct", False), ("direct", True)])
@pytest.mark.parametrize("cache", ["min", "half", "all"])
def test_streamed_equals_resident(model_dir, reference, io, odirect, cache):
    ref_logits, ref_tokens, _, _, spec = reference
    n_total = sum(spec.moe_layers) * spec.num_experts
    slots = {"min": spec.top_k, "half": n_total // 2, "all": n_total}[cache]
    with sluice.load(model_dir, memory=_memory_for(reference, slots), io=io, odirect=odirect) as m:
        assert m.store.n_slots == slots
        logits = m.logits(IDS)
        tokens = list(m.generate_tokens(IDS, max_tokens=8, stop_at_eos=False))
        st = m.stats()
    assert torch.equal(logits, ref_logits)  # bitwise
    assert tokens == ref_tokens
    # every byte read is a miss's, a prompt read-ahead's (the next layer's experts, read while a prompt runs) or a
    # decode guess's (--prefetch auto, the default, where the direct reader streams)
    reads = st["misses"] + st["prompt_prefetch_issued"] + st["prefetch_issued"]
    assert st["misses"] > 0 and st["bytes_read"] == reads * reference[3]
    if cache == "all":
        assert st["evictions"] == 0


def test_budget_too_small_names_smallest_budget(model_dir, reference):
    _, _, resident, expert, spec = reference
    with pytest.raises(BudgetError) as e:
        sluice.load(model_dir, memory=resident + (spec.top_k - 1) * expert)
    assert str(resident + spec.top_k * expert) in str(e.value)


def test_truncated_shard_while_running_raises_checkpoint_error(tmp_path, reference, model_dir):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(model_dir, folder)
    with sluice.load(folder, memory=_memory_for(reference, reference[4].top_k), io="direct") as m:
        shard = m.index.files[0]
        m.logits(IDS[:4])
        os.truncate(shard, m.resident_bytes // 4)  # cut into the expert bytes
        with pytest.raises(CheckpointError) as e:
            m.logits(IDS)
        assert shard.name in str(e.value)


@pytest.mark.parametrize("embeddings", ["mmap", "direct"])
@pytest.mark.parametrize("io", ["mmap", "willneed", "direct"])
def test_lazy_embeddings_equal_resident(model_dir, reference, io, embeddings):
    ref_logits, ref_tokens, _, _, spec = reference
    with sluice.load(model_dir, memory=_memory_for(reference, spec.top_k), io=io, embeddings=embeddings) as m:
        assert m.model.w.embed is None  # the table stays on disk
        logits = m.logits(IDS)
        tokens = list(m.generate_tokens(IDS, max_tokens=8, stop_at_eos=False))
        st = m.stats()
    assert torch.equal(logits, ref_logits)
    assert tokens == ref_tokens
    assert 0 < st["embedding_rows_read"] <= len(set(IDS)) + 8 + len(set(IDS))


@pytest.mark.parametrize("io,odirect", [("mmap", False), ("willneed", False), ("direct", False), ("direct", True)])
@pytest.mark.parametrize("cache", ["min", "half", "all"])
def test_prefetch_keeps_output_exact(model_dir, reference, io, odirect, cache):
    ref_logits, ref_tokens, _, _, spec = reference
    n_total = sum(spec.moe_layers) * spec.num_experts
    slots = {"min": spec.top_k, "half": n_total // 2, "all": n_total}[cache]
    with sluice.load(model_dir, memory=_memory_for(reference, slots), io=io, odirect=odirect,
                     prefetch="router", prefetch_margin=spec.num_experts) as m:  # margin: predict every expert
        logits = m.logits(IDS)
        tokens = list(m.generate_tokens(IDS, max_tokens=8, stop_at_eos=False))
        st = m.stats()
    assert torch.equal(logits, ref_logits)
    assert tokens == ref_tokens
    # with "min" every slot is pinned by the current layer; with "all" nothing is missing; mixtral's "half" is 4 slots,
    # the current layer's 2 pinned and 2 of the next layer's guessed experts, which a guess never evicts: none read
    if cache == "half" and slots > 2 * spec.top_k:
        assert st["prefetch_issued"] > 0
    assert st["prefetch_recall"] == 1.0  # a margin of E predicts every expert


@pytest.mark.parametrize("prefetch", ["none", "router"])
def test_victims_at_once_place_what_one_at_a_time_places(model_dir, reference, prefetch):
    """The store's misses and decode guesses take their victims from one sort of the layer's entries
    (policy.victims); with that switched off (_victim per expert) every acquire leaves the same experts in the same
    slots, the counters agree and the tokens are the same."""
    ref_logits, ref_tokens, _, _, spec = reference
    n_total = sum(spec.moe_layers) * spec.num_experts
    runs = []
    for at_once in (True, False):
        with sluice.load(model_dir, memory=_memory_for(reference, n_total // 2), io="direct", prefetch=prefetch,
                         prefetch_margin=0) as m:
            store, states = m.store, []
            if not at_once:
                store._victims = lambda layer, n, keep=None: None
            acquire = store.acquire

            def recorded(layer, experts, _acquire=acquire, _store=store, _states=states):
                batch = _acquire(layer, experts)
                _states.append((layer, [_store.table.owner(s) for s in range(_store.n_slots)], list(batch.slots)))
                return batch

            store.acquire = recorded
            tokens = list(m.generate_tokens(IDS, max_tokens=8, stop_at_eos=False))
            st = m.stats()
        runs.append((states, tokens, {k: st[k] for k in ("hits", "misses", "evictions", "prefetch_issued")}))
    assert runs[0][2]["evictions"] > 0  # the cache was full: victims were chosen
    if prefetch == "router":
        assert runs[0][2]["prefetch_issued"] > 0
    assert runs[0] == runs[1]
    assert runs[0][1] == ref_tokens


class _SpyReader:
    """Wraps a reader and records every destination buffer a prefetch writes, to check against pinned slots."""

    def __init__(self, inner, store_ref):
        self.inner, self.store_ref, self.violations = inner, store_ref, 0
        self.in_prefetch = False  # demand reads (submitted by acquire) fill pinned slots by design

    def read(self, requests):
        return self.inner.read(requests)

    def submit(self, requests):
        store = self.store_ref[0]
        for _, dest in requests if self.in_prefetch else ():
            base = (dest if isinstance(dest, torch.Tensor) else torch.frombuffer(dest, dtype=torch.uint8)).data_ptr()
            for s in store.table.pinned:
                start = store.raw[s].data_ptr()
                if start <= base < start + store.raw.shape[1]:
                    self.violations += 1
        return self.inner.submit(requests)

    def submit_each(self, batches):
        return [self.submit(b) for b in batches]

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_prefetch_never_evicts_pinned_slots(model_dir, reference):
    """Smallest budget (top_k slots, all pinned by the current layer) and a huge margin: prefetch finds no slot
    it may take, never writes into a pinned one, and the output stays exact."""
    ref_logits, ref_tokens, _, _, spec = reference
    with sluice.load(model_dir, memory=_memory_for(reference, spec.top_k), io="direct",
                     prefetch="router", prefetch_margin=spec.num_experts) as m:
        box = [m.store]
        spy = _SpyReader(m.store.reader, box)
        m.store.reader = spy
        prefetch = m.store.prefetch

        def spied_prefetch(*args, **kw):
            spy.in_prefetch = True
            try:
                prefetch(*args, **kw)
            finally:
                spy.in_prefetch = False

        m.store.prefetch = spied_prefetch
        tokens = list(m.generate_tokens(IDS, max_tokens=8, stop_at_eos=False))
        assert spy.violations == 0
    assert tokens == ref_tokens



def test_decode_allocates_no_weight_sized_tensor(model_dir, reference):
    """In-place slots: a streamed decode step (misses, prefetch and all) allocates only activation-sized buffers,
    never a copy of an expert (no per-step stack/cat of weights)."""
    from torch.profiler import ProfilerActivity, profile

    _, _, _, _, spec = reference
    with sluice.load(model_dir, memory=_memory_for(reference, spec.top_k + 2), io="direct", prefetch="router") as m:
        list(m.generate_tokens(IDS[:6], max_tokens=3, stop_at_eos=False))
        misses0 = m.store.misses
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            for pos, tok in enumerate(IDS[6:10], start=8):
                m.model.forward(torch.tensor([tok]), pos)
        assert m.store.misses > misses0  # the profiled steps did read experts into slots
        fmt = m.layout.format(m.layout.layers[0])
        smallest_projection = min(fmt.gate.nbytes, fmt.down.nbytes)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < largest < smallest_projection



def test_batch_arrived_says_whether_wait_would_block():
    """ExpertBatch.arrived: true for a slot never pending or waited for, and for a pending one whose read has landed
    (the store's non-blocking check); the decode loop runs those landed experts in one call with the one waited for."""
    from concurrent.futures import Future

    from sluice.store.base import ExpertBatch

    landed, flying = Future(), Future()
    landed.set_result(None)
    waited = []
    b = ExpertBatch(None, None, [0, 1, 2, 3], {1: lambda: waited.append(1), 2: lambda: waited.append(2),
                                                  3: lambda: waited.append(3)},
                    landed={1: landed.done, 2: flying.done})
    assert b.arrived(0) and b.arrived(1) and not b.arrived(2) and not b.arrived(3)  # 3: no check given
    b.wait(1)
    assert waited == [1] and b.ready(1) and b.arrived(1)


def test_a_landed_guess_is_ready_and_a_failed_one_raises_at_use(model_dir, reference):
    """acquire of experts whose guessed reads are over: one that landed is ready at once (nothing to wait for), one
    whose read failed raises the read's error when the math waits for it, and the store forgets the batch."""
    from concurrent.futures import Future

    _, _, _, _, spec = reference
    with sluice.load(model_dir, memory=_memory_for(reference, spec.top_k + 4), io="direct") as m:
        store, L = m.store, m.layout.layers[0]
        store._stream = False  # Python's path, its futures in _pending (test_stream_native.py has C's)
        a, b = [e for e in range(spec.num_experts) if (L, e) not in store.table][:2]
        store.prefetch(L, [a, b])
        assert (L, a) in store._pending and (L, b) in store._pending
        for key in ((L, a), (L, b)):
            store._pending[key].result()  # landed
        landed, failed = Future(), Future()
        landed.set_result(None)
        failed.set_exception(CheckpointError("the read failed", file="shard"))
        store._pending[(L, a)], store._pending[(L, b)] = landed, failed
        batch = store.acquire(L, sorted([a, b]))
        ja, jb = (0, 1) if a < b else (1, 0)
        assert batch.ready(ja) and not batch.ready(jb)
        with pytest.raises(CheckpointError, match="the read failed"):
            batch.wait(jb)
        store.release(L)
        assert (L, a) not in store.table and (L, b) not in store.table  # the batch is forgotten
