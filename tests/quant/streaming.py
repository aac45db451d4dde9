"""The check every quantized format passes: a streamed run gives bitwise the resident run's logits and tokens."""

from __future__ import annotations

import torch

import sluice


def assert_streamed_equals_resident(path, ids: list[int], io: str, odirect: bool, cache: str, **kw) -> dict:
    """Load `path` resident, then streamed through `io` with the smallest cache ("min": top_k slots) or half the
    experts ("half"); logits and 6 greedy tokens must be bitwise equal. `kw`: more load options for both. Returns
    the streamed run's stats."""
    with sluice.load(path, memory="all", **kw) as m:
        want = m.logits(ids)
        tokens = list(m.generate_tokens(ids, max_tokens=6, stop_at_eos=False))
        resident, spec, layout = m.resident_bytes, m.spec, m.layout
    slots = spec.top_k if cache == "min" else layout.total_experts // 2
    with sluice.load(path, memory=resident + slots * layout.expert_nbytes, io=io, odirect=odirect, **kw) as m:
        # slots placed at the files' O_DIRECT alignment (store/streaming.py) are a block and a page longer: fewer fit
        placed = bool(m.store._shift)
        assert m.store.n_slots == slots if not placed else spec.top_k <= m.store.n_slots <= slots
        assert torch.equal(m.logits(ids), want)
        assert list(m.generate_tokens(ids, max_tokens=6, stop_at_eos=False)) == tokens
        st = m.stats()
    assert st["misses"] > 0
    return st
