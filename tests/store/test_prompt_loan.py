"""A streamed prompt longer than the plan's chunk borrows expert slots for longer passes (store/budget.py PromptLoan,
StreamingExpertStore.lend): the slots' pages go back to the kernel while the prompt runs, the passes take the prompt's
tokens at once, and the slots come back, empty, afterwards. The logits are bitwise a resident run's with the same
passes, and decoding after it is unchanged."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

import sluice
from sluice.commands.common import stats_line
from sluice.host.memory import MemoryRoom
from sluice.models.model import Transformer
from sluice.options import LoadOptions
from sluice.plan import plan
from sluice.store.budget import (LEND_KEEP_LAYERS, PREFILL_MIN, RUNTIME_RESERVE, PromptLoan, prefill_token_bytes,
                                 prompt_loan)

from sluice.units import format_bytes

from ..models.tiny import hf_model, write_checkpoint

PROMPT = torch.randint(0, 300, (600,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # experts of 192 KiB (above a page: the lent slots free whole pages) and more of them than the two layers the
    # store keeps while it lends
    model = hf_model("qwen3_moe", torch.bfloat16, max_position_embeddings=1024, num_experts=32,
                     moe_intermediate_size=512, num_hidden_layers=4)
    return write_checkpoint(model, tmp_path_factory.mktemp("loan"), "per_expert")


def _room(monkeypatch, room: int) -> None:
    monkeypatch.setattr("sluice.plan.available_memory", lambda: MemoryRoom(room, "cgroup /test limit"))
    monkeypatch.setattr("sluice.plan.memory_status", lambda: {"rss_anon_bytes": RUNTIME_RESERVE})


def _streamed(model_dir, monkeypatch, **options):
    """Options and a room that stream all but one expert and leave the passes exactly PREFILL_MIN tokens' room."""
    with sluice.load(model_dir, memory="all") as m:
        budget = m.resident_bytes + (m.layout.total_experts - 1) * m.layout.expert_nbytes
        per_token = prefill_token_bytes(m.spec, 2, m.max_context)
        kv = m.load_plan.kv_bytes
    _room(monkeypatch, budget + kv + PREFILL_MIN * per_token * 5 // 4)  # the span's hidden states take a share
    return dict(memory=budget, io="direct", **options)


def _chunks(m) -> list[int]:
    """Spy on the passes a model runs (forward runs forward_layers too): the token count of each prompt pass."""
    seen: list[int] = []
    fl = Transformer.forward_layers

    def forward_layers(self, tokens, pos, chunk, between=None):
        if len(tokens) > 1:
            seen.extend([min(chunk, len(tokens) - s) for s in range(0, len(tokens), chunk)])
        return fl(self, tokens, pos, chunk, between)

    m.model.forward_layers = forward_layers.__get__(m.model)
    return seen


def test_a_long_prompt_borrows_slots_with_a_resident_runs_bits(model_dir, monkeypatch):
    opts = _streamed(model_dir, monkeypatch)
    with sluice.load(model_dir, **opts) as m:
        loan, store = m.prompt_loan, m.store
        assert loan is not None and m.prefill_chunk < len(PROMPT)
        assert loan.keep == LEND_KEEP_LAYERS * m.spec.num_experts
        seen = _chunks(m)
        logits = m.logits(PROMPT)
        wide = seen[0]
        assert seen == [len(PROMPT)] and wide > m.prefill_chunk, seen  # one pass of the whole prompt
        st = store.stats()
        assert st["prompt_loans"] == 1 and st["prompt_lent_bytes"] > 0
        assert store.max_batch == store.n_slots and not store._lent  # the slots are back
        assert len(store.table.free) + len(store.table) == store.n_slots  # every slot free or holding an expert
        seen.clear()
        m.forget_cache()  # the whole prompt again, not its reused prefix
        tokens = list(m.generate_tokens(PROMPT, max_tokens=6, stop_at_eos=False))
        assert seen == [len(PROMPT)] and store.stats()["prompt_loans"] == 2
        st = m.stats()
        assert st["prefill_pass_tokens"] == len(PROMPT) and 0 < st["prefill_lent_bytes"] <= loan.lendable
        assert (f"passes of {len(PROMPT)} tok in {format_bytes(st['prefill_lent_bytes'])} of lent slots"
                in stats_line(st))
        m.forget_cache()
        list(m.generate_tokens(PROMPT[:8], max_tokens=2, stop_at_eos=False))  # short: nothing lent, nothing said
        assert "prefill_lent_bytes" not in m.stats() and "lent slots" not in stats_line(m.stats())
        short = m.logits(PROMPT[: m.prefill_chunk])  # no longer than the chunk: nothing borrowed
        assert store.stats()["prompt_loans"] == 2
    monkeypatch.undo()  # this machine's room for the resident runs
    with sluice.load(model_dir, memory="all", prefill_chunk=wide) as r:
        assert torch.equal(logits, r.logits(PROMPT))
        assert tokens == list(r.generate_tokens(PROMPT, max_tokens=6, stop_at_eos=False))
    with sluice.load(model_dir, memory="all", prefill_chunk=m.prefill_chunk) as r:
        assert torch.equal(short, r.logits(PROMPT[: m.prefill_chunk]))


def test_an_explicit_chunk_or_a_resident_model_borrows_nothing(model_dir, monkeypatch):
    opts = _streamed(model_dir, monkeypatch)
    assert plan(model_dir, LoadOptions.make(**opts)).prompt_loan is not None
    assert plan(model_dir, LoadOptions.make(**opts, prefill_chunk=128)).prompt_loan is None
    assert plan(model_dir, LoadOptions.make(memory="all")).prompt_loan is None
    with sluice.load(model_dir, **opts, prefill_chunk=128) as m:
        seen = _chunks(m)
        m.logits(PROMPT)
        assert set(seen) == {128, len(PROMPT) % 128} and m.store.stats()["prompt_loans"] == 0


def _resident_pages(t: torch.Tensor) -> int:
    """Pages of tensor t's memory in RAM (mincore), t page-aligned."""
    n = -(-t.numel() * t.element_size() // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(t.data_ptr(), n * mmap.PAGESIZE, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


def test_lend_gives_the_pages_back_and_lend_back_returns_empty_slots(model_dir, monkeypatch):
    opts = _streamed(model_dir, monkeypatch)
    with sluice.load(model_dir, **opts) as m:
        store, keep = m.store, m.prompt_loan.keep
        m.logits(PROMPT[:64])  # some experts cached
        stride = store.raw.shape[1]
        n = store.n_slots - keep
        assert store.raw.data_ptr() % mmap.PAGESIZE == 0 and stride % mmap.PAGESIZE == 0  # page-aligned slots
        tail = store.raw[store.n_slots - n:]
        assert _resident_pages(tail) == tail.numel() // mmap.PAGESIZE
        assert store.lend(1 << 40, keep) == n * stride  # asked for more than it has: all but `keep`
        assert _resident_pages(tail) == 0 and store.max_batch == keep
        assert all(store.table.owner(s) is None for s in range(keep, store.n_slots))
        assert store.lend(stride, keep) == 0  # one loan at a time
        with pytest.raises(ValueError, match="slots"):
            store.acquire(0, list(range(keep + 1)))  # more than the slots left
        store.lend_back()
        store._populated()  # its thread's pages in
        assert _resident_pages(tail) == tail.numel() // mmap.PAGESIZE and store.max_batch == store.n_slots
        assert sorted(store.table.free)[-n:] == list(range(keep, store.n_slots))
        m.logits(PROMPT[:64])  # the store works as before


def test_the_loan_sizes_a_pass_from_the_room_and_what_is_lent():
    loan = PromptLoan(chunk=256, room=256 * 100, fixed=1000, per_token=100, widest=4096, keep=128,
                      lendable=10_000 * 100)
    assert loan.borrow(200) == 0 and loan.borrow(256) == 0  # no longer than the chunk
    assert loan.borrow(2048) == 1000 + 2048 * 100 - 256 * 100
    assert loan.borrow(100_000) == 1000 + 4096 * 100 - 256 * 100  # at most the widest pass
    assert loan.chunk_for(2048, loan.borrow(2048)) == 2048
    assert loan.chunk_for(2048, 10 * 100) == 256  # too little lent: never below the plan's chunk
    assert loan.chunk_for(2048, 1000 + 100 * 100) == 342  # 6 passes of at most 356 tokens, equal: 342
    assert loan.chunk_for(2048, 1000 + 1703 * 100) == 1024  # 1,959 tokens' room: two passes of 1,024
    small = PromptLoan(chunk=256, room=0, fixed=0, per_token=100, widest=4096, keep=128, lendable=500 * 100)
    assert small.borrow(2048) == 500 * 100 and small.chunk_for(2048, 500 * 100) == 410  # 5 passes
    assert small.widest_pass() == 500 and loan.widest_pass() == 4096


def test_prompt_loan_keeps_two_layers_of_experts():
    class S:
        num_experts, hidden_size, top_k, moe_intermediate_size = 64, 64, 2, 32
        shared_expert_intermediate_size, dense_intermediate_size, moe_layers = 0, 0, [True]
        attn_gate, n_heads, n_kv_heads, head_dim = False, 2, 1, 32
        mla = delta = ple = qsa = None
        hc_count = 1

    assert prompt_loan(S, 2, 4096, 256, 0, slots=2 * 64, expert_bytes=1000) is None  # nothing beyond the kept layers
    loan = prompt_loan(S, 2, 4096, 256, 0, slots=2 * 64 + 10, expert_bytes=1000)
    assert loan.lendable == 10_000 and loan.keep == 128 and loan.widest == 4096
    assert prompt_loan(S, 2, 256, 256, 0, slots=1000, expert_bytes=1000) is None  # the chunk is the widest pass


def test_auto_memory_sets_no_room_aside_for_passes_the_slots_can_lend(model_dir, monkeypatch):
    """`--memory auto` left STREAMED_PROMPT_TOKENS tokens' passes out of the budget; where the budget's slots can lend
    them it keeps the whole room for the slots (tests/store/test_prefill.py: where they cannot, the room is set
    aside)."""
    from sluice.store.budget import STREAMED_PROMPT_TOKENS, prefill_pass_bytes

    with sluice.load(model_dir, memory="all") as m:
        resident, expert, kv = m.resident_bytes, m.layout.expert_nbytes, m.load_plan.kv_bytes
        total = m.layout.total_experts
    monkeypatch.setattr("sluice.plan.STREAMED_PROMPT_TOKENS", 200)  # within the small model's lendable slots
    _room(monkeypatch, resident + (total - 1) * expert + kv)  # streams (the runtime is held already)
    p = plan(model_dir, LoadOptions.make(memory="auto", io="direct", odirect=True))
    assert p.memory is not None and p.memory_plan.prompt == 0
    assert p.prompt_loan.lendable >= prefill_pass_bytes(p.spec, 2, p.max_context, 200, p.max_context)
    assert STREAMED_PROMPT_TOKENS == 1024
    monkeypatch.setattr("sluice.plan.STREAMED_PROMPT_TOKENS", 1024)  # more than they can lend: set aside as before
    p = plan(model_dir, LoadOptions.make(memory="auto", io="direct", odirect=True))
    assert p.memory_plan.prompt > 0


def test_inspect_prints_the_loan(model_dir, monkeypatch, capsys):
    from sluice import cli

    opts = _streamed(model_dir, monkeypatch)
    loan = plan(model_dir, LoadOptions.make(**opts)).prompt_loan
    assert cli.main(["inspect", str(model_dir), "--memory", str(opts["memory"]), "--io", "direct",
                     "--usage-tokens", "0"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("longer prompts:"))
    assert line == (f"longer prompts: passes of up to {loan.widest_pass()} tokens in expert slots lent while they run "
                    f"(up to {format_bytes(loan.lendable)}; the store keeps {loan.keep} slots)")
    assert loan.widest_pass() > loan.chunk


def test_a_prompt_that_fails_midway_gives_the_slots_back(model_dir, monkeypatch):
    """An error inside the borrowed passes (here the last layer raising) still returns the lent slots: the store is
    whole and the model runs the next prompt as before."""
    opts = _streamed(model_dir, monkeypatch)
    with sluice.load(model_dir, **opts) as m:
        store, layers = m.store, m.model.layers
        expected = m.logits(PROMPT)

        def broken(x, step):
            assert store._lent > 0  # inside the loan
            raise RuntimeError("a layer failed")

        m.model.layers = layers[:-1] + [broken]
        with pytest.raises(RuntimeError, match="a layer failed"):
            m.logits(PROMPT)
        assert not store._lent and store.max_batch == store.n_slots
        assert len(store.table.free) + len(store.table) == store.n_slots
        m.model.layers = layers
        assert torch.equal(m.logits(PROMPT), expected) and store.stats()["prompt_loans"] == 3
