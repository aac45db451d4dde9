"""Streamed prefill reads each touched expert once per layer per chunk, and the chunk follows the memory rule.

The MoE block runs a chunk expert-major (models/blocks.py Transformer.experts): every expert the chunk's tokens
route to is acquired once, in passes of at most the store's slots, so a chunk costs exactly its touched experts'
bytes whatever the cache size; and the result is bitwise the resident run's for any prompt length and reader.
"""

from __future__ import annotations

import pytest
import torch

import sluice
from sluice.store.budget import PREFILL_MAX, PREFILL_MIN, prefill_tokens_per_chunk

from ..models.tiny import hf_model, write_checkpoint

LONG = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(9)).tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(hf_model("qwen3_moe", torch.bfloat16), tmp_path_factory.mktemp("prefill"), "per_expert")


@pytest.fixture(scope="module")
def resident(model_dir):
    """Logits of LONG, the (layer, expert) pairs it touches, and the sizes a budget is made of."""
    with sluice.load(model_dir, memory="all") as m:
        touched: set[tuple[int, int]] = set()
        acquire = m.store.acquire
        m.store.acquire = lambda L, ids: (touched.update((L, e) for e in ids), acquire(L, ids))[1]
        logits = m.logits(LONG)
        return logits, touched, m.resident_bytes, m.layout.expert_nbytes, m.spec


@pytest.mark.parametrize("io", ["mmap", "willneed", "direct"])
def test_one_chunk_reads_each_touched_expert_once(model_dir, resident, io):
    logits, touched, resident_bytes, expert, spec = resident
    assert len(touched) < sum(spec.moe_layers) * spec.num_experts or len(LONG) > 100  # a spread prompt
    with sluice.load(model_dir, memory=resident_bytes + spec.top_k * expert, io=io) as m:  # the smallest cache
        assert m.prefill_chunk >= len(LONG)  # one chunk
        got = m.logits(LONG)
        st = m.stats()
    assert torch.equal(got, logits)  # bitwise the resident run
    assert st["misses"] == len(touched)  # fewer slots than touched experts: passes, never a re-read
    assert st["bytes_read"] == len(touched) * expert


def test_smaller_chunks_reread(model_dir, resident):
    _, touched, resident_bytes, expert, spec = resident
    with sluice.load(model_dir, memory=resident_bytes + spec.top_k * expert, io="direct", prefill_chunk=50) as m:
        assert m.prefill_chunk == 50
        m.logits(LONG)
        assert m.stats()["misses"] > len(touched)  # each of the 4 chunks reads its layer's experts again


def test_chunk_follows_the_activation_room(resident):
    spec = resident[4]
    assert prefill_tokens_per_chunk(spec, 2) == PREFILL_MAX  # a tiny model: the cap
    big = prefill_tokens_per_chunk(spec.__class__(**{**spec.__dict__, "hidden_size": 7168, "top_k": 8,
                                                      "moe_intermediate_size": 2048}), 2)
    assert big == PREFILL_MIN  # DeepSeek-sized rows: the floor
    mid = spec.__class__(**{**spec.__dict__, "hidden_size": 1024, "top_k": 8, "moe_intermediate_size": 512})
    one, two = prefill_tokens_per_chunk(mid, 2), prefill_tokens_per_chunk(mid, 2, room=2 * 2**20 * 64)
    assert PREFILL_MIN < one < PREFILL_MAX and two == min(PREFILL_MAX, 2 * one) or two in (2 * one, 2 * one + 1)


def test_stats_report_the_prefill_reads(model_dir, resident):
    _, touched, resident_bytes, expert, spec = resident
    with sluice.load(model_dir, memory=resident_bytes + spec.top_k * expert, io="direct") as m:
        m.replay(LONG, [5, 6])  # prefill, then two decode steps whose reads must not count as the prefill's
        st = m.stats()
    by_layer = [sum(1 for (L, _) in touched if L == layer) for layer in range(spec.n_layers)]
    assert st["prefill_expert_reads_by_layer"] == by_layer
    assert st["prefill_bytes_read"] == len(touched) * expert < st["bytes_read"]
    assert st["prefill_bytes_per_token"] == round(len(touched) * expert / len(LONG), 1)
    assert st["misses_by_layer"] != by_layer  # the decode steps read more


def test_resident_stats_have_no_prefill_reads(model_dir):
    with sluice.load(model_dir, memory="all") as m:
        m.replay(LONG[:20], [5])
        st = m.stats()
    assert st["prefill_bytes_read"] == 0 and st["prefill_expert_reads_by_layer"] == [0] * m.spec.n_layers
