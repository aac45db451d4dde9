"""A streamed decode token's MoE layer as one native call (store/stream.c sluice_stream_layer through
StreamingExpertStore.run_layer, from layers/moe_decode.py): the acquire, the experts while the guess's reads are
queued, the release. Against the same steps as separate calls: the resident run's tokens bit for bit, and the same
store counters (hits, misses, evictions, bytes, the guesses' reads); a file changed under it fails the run naming the
file; a layer whose expert is not in memory yet goes on as after acquire."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

pytest.importorskip("gguf")

import sluice  # noqa: E402
from sluice.errors import CheckpointError  # noqa: E402
from sluice.models.layers.moe_decode import MoEDecode  # noqa: E402
from sluice.quant import native  # noqa: E402
from sluice.store import stream_native  # noqa: E402
from sluice.store.stream_native import NativeStream  # noqa: E402

from ..models.tiny import q8_qwen35_gguf  # noqa: E402

pytestmark = pytest.mark.skipif(not (native.available() and stream_native.available()),
                                reason="the native extension or sluice/store/stream.c is not built")
IDS = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(11)).tolist()
COUNTERS = ("hits", "misses", "misses_by_layer", "evictions", "bytes_read", "prefetch_issued", "prefetch_used",
            "prefetch_wasted", "prefetch_recall", "prefetch_paused")


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    return q8_qwen35_gguf(tmp_path_factory.mktemp("layer"), num_experts=16)


def _streamed(path, slots: int = 8, **options):
    with sluice.load(path, memory="all") as m:
        memory = m.resident_bytes + slots * m.layout.expert_nbytes
    return sluice.load(path, memory=memory, io="direct", **{"prefetch": "router", "threads": 2, **options})


def _blocks(m) -> list[MoEDecode]:
    return [layer.ffn.decode for layer in m.model.layers if getattr(layer.ffn, "decode", None) is not None]


def _count_calls(m) -> dict:
    """store.run_layer wrapped: how many layers it finished (None) and how many it handed back (a batch)."""
    seen = {"done": 0, "batch": 0}
    run = m.store.run_layer

    def counted(*a):
        got = run(*a)
        seen["done" if got is None else "batch"] += 1
        return got

    m.store.run_layer = counted
    return seen


def test_one_call_layers_give_the_resident_tokens_and_the_separate_calls_counters(q8_file):
    with sluice.load(q8_file, memory="all") as m:
        want = list(m.generate_tokens(IDS, max_tokens=16, stop_at_eos=False))
    with _streamed(q8_file) as a, _streamed(q8_file) as b:
        assert _blocks(a) and all(d.fusable is not None for d in _blocks(a))
        seen = _count_calls(a)
        guessed = []
        stream_guessed = NativeStream.guessed
        for d in _blocks(b):
            d.fusable = None  # the separate calls
        b.store.guess_later = None  # and the guesses made by the prerouter in Python, before the layer
        NativeStream.guessed = lambda self, k: guessed.append(k) or stream_guessed(self, k)
        try:
            assert list(a.generate_tokens(IDS, max_tokens=16, stop_at_eos=False)) == want
        finally:
            NativeStream.guessed = stream_guessed
        assert list(b.generate_tokens(IDS, max_tokens=16, stop_at_eos=False)) == want
        assert isinstance(a.store._stream, NativeStream)
        assert seen["done"] > 0  # layers with every expert in memory took the one call
        assert guessed  # ... the next layer's guess made in it
        sa, sb = a.stats(), b.stats()
        assert sa["prefetch_issued"] > 0 and sa["misses"] > 0
        assert {k: sa[k] for k in COUNTERS} == {k: sb[k] for k in COUNTERS}


@pytest.mark.parametrize("options", [dict(threads=1), dict(io_engine="native"), dict(prefetch="none", slots=48)],
                         ids=["one thread", "reader threads", "no guess"])
def test_one_call_layers_on_one_thread_the_reader_threads_and_without_guesses(q8_file, options):
    """One thread (the experts' call runs whole where the pool cannot start it), the thread-pool reader instead of the
    io_uring one, no guesses (a cache of most experts, so layers find theirs in memory): the one call still takes
    the layers in memory and gives the resident tokens."""
    with sluice.load(q8_file, memory="all") as m:
        want = list(m.generate_tokens(IDS, max_tokens=12, stop_at_eos=False))
    with _streamed(q8_file, **options) as m:
        seen = _count_calls(m)
        assert list(m.generate_tokens(IDS, max_tokens=12, stop_at_eos=False)) == want
        assert seen["done"] > 0


def test_a_layer_with_an_expert_not_in_memory_goes_on_as_after_acquire(q8_file):
    """At the smallest cache nearly every layer misses: the call leaves the acquire done and the block's late path
    runs the rest (the resident tokens all the same)."""
    with sluice.load(q8_file, memory="all") as m:
        want = list(m.generate_tokens(IDS, max_tokens=8, stop_at_eos=False))
        k = m.spec.top_k
    with _streamed(q8_file, slots=k) as m:
        seen = _count_calls(m)
        assert list(m.generate_tokens(IDS, max_tokens=8, stop_at_eos=False)) == want
        assert seen["batch"] > 0
        assert not m.store.table.pinned  # every layer released


@pytest.mark.parametrize("change", ["truncated", "rewritten"])
def test_a_file_changed_under_the_one_call_fails_the_run_naming_it(q8_file, tmp_path, change):
    path = tmp_path / q8_file.name
    shutil.copy(q8_file, path)
    with _streamed(path, slots=2 if change == "truncated" else 8) as m:
        seen = _count_calls(m)
        it = m.generate_tokens(IDS, max_tokens=40, stop_at_eos=False)
        for _ in range(3):
            next(it)
        assert seen["done"] + seen["batch"] > 0
        if change == "truncated":
            os.truncate(path, os.path.getsize(path) - 1)
        else:  # the same size, a new modification time: its bytes may not be the ones the header described
            st = os.stat(path)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        # the call's own check (one fstat a file, in C) refuses it before anything is placed or read
        store, L = m.store, m.layout.layers[0]
        ids = [e for e in range(m.spec.num_experts) if (L, e) not in store.table][: m.spec.top_k]
        assert store._stream.layer(L, ids, store.table.usage_row(L), 0, -1, ()) == 2
        assert not store.table.pinned and all((L, e) not in store.table for e in ids)
        with pytest.raises(CheckpointError) as e:
            for _ in it:
                pass
        assert path.name in str(e.value) and change in str(e.value)


def test_a_guess_out_of_range_is_named_by_placed(q8_file):
    """A guess handed to the call with an id out of range: the layer's experts run, its placement is refused (-2)
    and placed() names the guess's ids (listed from the call's scratch only then)."""
    with _streamed(q8_file, slots=48, prefetch="none") as m:
        for _ in m.generate_tokens(IDS, max_tokens=4, stop_at_eos=False):
            pass
        store, k, E = m.store, m.spec.top_k, m.spec.num_experts
        L, nxt = m.layout.layers[0], m.layout.layers[1]
        ids = sorted(e for e in range(E) if (L, e) in store.table)[:k]
        assert len(ids) == k
        ex = next(d for d in _blocks(m) if d.L == L).experts
        x = torch.randn(1, ex.h, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
        w, at, out = torch.full((1, k), 1.0 / k, dtype=torch.bfloat16), torch.arange(k), torch.empty_like(x)
        ctx = ex.prepared(store._at(L)[0], x, w, at, out)
        assert store._stream.layer(L, ids, store.table.usage_row(L), ctx, nxt, [1, E + 3]) == 0
        assert not store.table.pinned
        with pytest.raises(ValueError, match=rf"prefetch of layer {nxt}: expert ids \[1, {E + 3}\] out of range"):
            store._stream.placed()


def test_a_call_refused_before_c_reports_nothing_of_the_last_one(q8_file):
    """_layer_call returning 2 without calling C (the reader not usable now) leaves the stream's report cleared: the
    guess the last call made there is not read as this one's (run_layer asks made() then)."""
    with _streamed(q8_file) as m:
        store, stream_run = m.store, m.store.run_layer
        seen = []

        def run(layer, experts, ctx):
            got = stream_run(layer, experts, ctx)
            stream = store._stream
            if got is None and not seen and stream.made() == 1:  # between two layers: nothing pinned, nothing held
                queue = stream.queue
                queue.usable = lambda: False
                try:
                    seen.append(store._layer_call(stream, layer, experts, ctx, -1, (), None))
                finally:
                    del queue.usable
                seen.append(stream.made())
            return got

        store.run_layer = run
        for _ in m.generate_tokens(IDS, max_tokens=6, stop_at_eos=False):
            pass
        assert seen == [2, 0]


def _tied(m) -> int:
    """Every MoE layer's router row 1 made row 0's (the true route's ties resolved as torch.topk does) and the
    prerouter's guesses left to torch.topk on a tie (no topk.cc): how many guesses it has."""
    routers = [layer.ffn.lw.router for layer in m.model.layers if getattr(layer.ffn, "lw", None) is not None]
    assert routers
    for router in routers:
        router[1] = router[0]
    guesses = m.model.prerouter._guess.values()
    for g in guesses:
        g.ties, g._packed = None, None
    return len(guesses)


def test_a_guess_torch_topk_ranks_is_queued_after_the_call(q8_file):
    """A guess the call leaves to torch.topk (a tie, no topk.cc: made() 2) is ranked and queued after it, as the
    separate calls' guess made in Python is: the same tokens and counters."""
    with _streamed(q8_file) as a, _streamed(q8_file) as b:
        assert _tied(a) and _tied(b)
        made = []
        stream_made = NativeStream.made
        NativeStream.made = lambda self: made.append(stream_made(self)) or made[-1]
        for d in _blocks(b):
            d.fusable = None
        b.store.guess_later = None
        try:
            got = list(a.generate_tokens(IDS, max_tokens=12, stop_at_eos=False))
        finally:
            NativeStream.made = stream_made
        assert list(b.generate_tokens(IDS, max_tokens=12, stop_at_eos=False)) == got
        assert made.count(2) > 0 and made.count(1) > 0
        sa, sb = a.stats(), b.stats()
        assert sa["prefetch_issued"] > 0
        assert {k: sa[k] for k in COUNTERS} == {k: sb[k] for k in COUNTERS}
