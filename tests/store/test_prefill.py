"""Streamed prefill reads each touched expert once per layer per chunk, and the chunk follows the memory rule: `auto`
takes as many tokens as the activation room holds, the room being what the memory this process may take leaves
beside the kept weights, the KV cache and the runtime reserve (halved when streamed reads use the page cache).

The MoE block runs a chunk expert-major (models/blocks.py Transformer.experts): every expert the chunk's tokens
route to is acquired once, in passes of at most the store's slots, so a chunk costs exactly its touched experts'
bytes whatever the cache size; and the result is bitwise the resident run's for any prompt length and reader.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import sluice
from sluice import cli
from sluice.errors import BudgetError
from sluice.quant.matmul import packable
from sluice.models.layers import experts, moe
from sluice.host.memory import MemoryRoom
from sluice.options import LoadOptions
from sluice.plan import plan
from sluice.store.budget import (PREFILL_MAX, PREFILL_MIN, PREFILL_ROOM, RUNTIME_RESERVE, SPAN_SHARE, activation_room,
                                 hidden_token_bytes, kept_bytes, prefill_token_bytes, prefill_tokens_per_chunk)

from ..models.tiny import hf_model, write_checkpoint

LONG = torch.randint(0, 300, (2048,), generator=torch.Generator().manual_seed(9)).tolist()  # the prompt


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model = hf_model("qwen3_moe", torch.bfloat16, max_position_embeddings=4096)
    return write_checkpoint(model, tmp_path_factory.mktemp("prefill"), "per_expert")


@pytest.fixture(scope="module")
def resident(model_dir):
    """Logits of LONG, the (layer, expert) pairs it touches, and the sizes a budget is made of."""
    with sluice.load(model_dir, memory="all") as m:
        assert m.prefill_chunk >= len(LONG)  # one chunk, as the streamed runs: bitwise claims need the same shapes
        touched: set[tuple[int, int]] = set()
        acquire = m.store.acquire
        m.store.acquire = lambda L, ids: (touched.update((L, e) for e in ids), acquire(L, ids))[1]
        logits = m.logits(LONG)
        return logits, touched, m.resident_bytes, m.layout.expert_nbytes, m.spec


@pytest.mark.parametrize("io", ["mmap", "willneed", "direct"])
def test_one_chunk_reads_each_touched_expert_once(model_dir, resident, io):
    logits, touched, resident_bytes, expert, spec = resident
    # a spread prompt: every MoE layer touches more experts than the cache below has slots (top_k), so the chunk
    # runs in passes
    per_layer = Counter(L for L, _ in touched)
    assert len(per_layer) == sum(spec.moe_layers) and min(per_layer.values()) > spec.top_k, per_layer
    with sluice.load(model_dir, memory=resident_bytes + spec.top_k * expert, io=io) as m:  # the smallest cache
        assert m.prefill_chunk >= len(LONG) and m.store.n_slots == spec.top_k  # one chunk, the smallest cache
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
    assert prefill_tokens_per_chunk(spec, 2, 4096) == PREFILL_MAX  # a tiny model: the cap
    big = spec.__class__(**{**spec.__dict__, "hidden_size": 7168, "top_k": 8, "moe_intermediate_size": 2048})
    assert prefill_tokens_per_chunk(big, 2, 4096) == PREFILL_MIN  # DeepSeek-sized rows: the floor
    mid = spec.__class__(**{**spec.__dict__, "hidden_size": 1024, "top_k": 8, "moe_intermediate_size": 512})
    per_token = prefill_token_bytes(mid, 2, 4096)
    assert 60 * 2**10 < per_token < 90 * 2**10  # the peers model's shape: measured 75 KiB a token (budget.py)
    assert prefill_tokens_per_chunk(mid, 2, 4096, room=1000 * per_token + per_token - 1) == 1000
    assert prefill_tokens_per_chunk(mid, 2, 4096, room=0) == PREFILL_MIN


def test_activation_room_is_what_the_plan_leaves():
    MiB = 2**20
    left = 1000 * MiB - 600 * MiB - 64 * MiB - RUNTIME_RESERVE
    assert activation_room(1000 * MiB, 600 * MiB, 64 * MiB, page_cache=False) == left
    assert activation_room(1000 * MiB, 600 * MiB, 64 * MiB, page_cache=True) == left // 2
    assert activation_room(500 * MiB, 600 * MiB, 64 * MiB, page_cache=False) == 0  # over: nothing, not negative
    # what the runtime already holds is out of the room: only the rest of the reserve is set aside
    assert activation_room(1000 * MiB, 600 * MiB, 64 * MiB, False, held=100 * MiB) == left + 100 * MiB
    assert activation_room(1000 * MiB, 600 * MiB, 64 * MiB, False, held=2 * RUNTIME_RESERVE) == left + RUNTIME_RESERVE
    assert kept_bytes(None, 10, 3, 8) == 10 + 3 * 8  # resident: every expert
    assert kept_bytes(10 + 3 * 5 + 2, 10, 3, 8) == 10 + 3 * 5  # the whole slots the budget buys
    assert kept_bytes(10**9, 10, 3, 8) == 10 + 3 * 8  # never more slots than experts


def _held(monkeypatch, held: int = 0) -> None:
    """Pretend this process holds `held` anonymous bytes (pytest's own vary from run to run)."""
    monkeypatch.setattr("sluice.plan.memory_status", lambda: {"rss_anon_bytes": held})


def _plan(model_dir, monkeypatch, room: int, source: str = "cgroup /test limit", **options):
    monkeypatch.setattr("sluice.plan.available_memory", lambda: MemoryRoom(room, source))
    _held(monkeypatch)
    return plan(model_dir, LoadOptions.make(**options))


def test_auto_chunk_follows_the_room_and_the_budget(model_dir, resident, monkeypatch):
    _, _, resident_bytes, expert, spec = resident
    small, big = resident_bytes + spec.top_k * expert, resident_bytes + 6 * spec.top_k * expert
    p = _plan(model_dir, monkeypatch, 2**40, memory=small, io="mmap")
    per_token, fixed = prefill_token_bytes(p.spec, 2, p.max_context), small + p.kv_bytes + RUNTIME_RESERVE
    assert p.prefill_chunk == PREFILL_MAX  # a room of 1 TiB: the mask's cap
    room = fixed + 2 * 1000 * per_token  # half of what is left (mmap reads use the page cache): 1,000 tokens
    at = _plan(model_dir, monkeypatch, room, memory=small, io="mmap")
    _fills(at, 1000 * per_token)  # streamed: the chunk and the layer-by-layer span's hidden states share the room
    assert PREFILL_MIN < _plan(model_dir, monkeypatch, room - 2**20, memory=small, io="mmap").prefill_chunk < 1000
    assert PREFILL_MIN < _plan(model_dir, monkeypatch, room, memory=big, io="mmap").prefill_chunk < 1000
    assert _plan(model_dir, monkeypatch, fixed, memory=small, io="mmap").prefill_chunk == PREFILL_MIN  # no room
    # O_DIRECT reads keep no expert bytes in the page cache: the activations may take all that is left
    direct = _plan(model_dir, monkeypatch, room, memory=small, io="direct", odirect=True)
    _fills(direct, 2000 * per_token)
    assert "all of what" in direct.prefill_why
    whole = kept_bytes(None, resident_bytes, expert, p.layout.total_experts)
    resident_run = _plan(model_dir, monkeypatch, whole + p.kv_bytes + RUNTIME_RESERVE + 1500 * per_token,
                         memory="all")
    assert resident_run.prefill_chunk == 1500
    unknown = _plan(model_dir, monkeypatch, 1 << 60, source="unknown (no /proc/meminfo, no memory cgroup)",
                    memory=small)
    assert unknown.prefill_chunk == prefill_tokens_per_chunk(p.spec, 2, p.max_context, PREFILL_ROOM)
    assert "unknown" in unknown.prefill_why
    # as given where its passes fit beside the budget; under a cgroup that leaves them no room, the BudgetError
    # naming them (they were not counted, and the kernel killed the process mid-prompt)
    assert _plan(model_dir, monkeypatch, fixed + 3000 * per_token, memory=small,
                 prefill_chunk=3000).prefill_chunk == 3000
    with pytest.raises(BudgetError, match="for --prefill-chunk's passes.*a smaller --prefill-chunk"):
        _plan(model_dir, monkeypatch, fixed, memory=small, prefill_chunk=3000)
    monkeypatch.setattr("sluice.plan.available_memory", lambda: MemoryRoom(room, "cgroup /test limit"))
    _held(monkeypatch, 2 * per_token * 500)  # the runtime already holds part of its reserve: 500 more tokens
    _fills(plan(model_dir, LoadOptions.make(memory=small, io="mmap")), 1500 * per_token)


def _fills(p, acts: int) -> None:
    """A streamed plan's chunk and span fill an activation room of `acts` bytes: the span's hidden states take
    SPAN_SHARE of it (at most max_context tokens), the chunk as many tokens as the rest holds."""
    per_token, h = prefill_token_bytes(p.spec, 2, p.max_context), hidden_token_bytes(p.spec, 2)
    assert p.prefill_span == min(p.max_context, int(max(acts, PREFILL_MIN * per_token) * SPAN_SHARE) // h)
    assert p.prefill_span > p.prefill_chunk
    assert p.prefill_chunk == (acts - p.prefill_span * h) // per_token, (p.prefill_chunk, p.prefill_span)


def test_inspect_prints_the_auto_chunk_and_its_room(model_dir, resident, monkeypatch, capsys):
    _, _, resident_bytes, expert, spec = resident
    small = resident_bytes + spec.top_k * expert
    p = _plan(model_dir, monkeypatch, 2**40, memory=small, io="mmap")
    room = small + p.kv_bytes + RUNTIME_RESERVE + 2 * 1000 * prefill_token_bytes(p.spec, 2, p.max_context)
    monkeypatch.setattr("sluice.plan.available_memory", lambda: MemoryRoom(room, "cgroup /test limit"))
    _held(monkeypatch)
    assert cli.main(["inspect", str(model_dir), "--memory", str(small), "--io", "mmap", "--usage-tokens", "0"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("prefill:"))
    chunk = plan(model_dir, LoadOptions.make(memory=small, io="mmap")).prefill_chunk
    assert line.startswith(f"prefill: {chunk} tokens per pass (auto") and "available (cgroup /test limit)" in line
    assert "streamed: up to 4096 tokens layer by layer" in line, line


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


@pytest.mark.parametrize("matmul", ["bf16", "float32"])
def test_streamed_prefill_is_the_resident_bits_with_either_matmul(model_dir, resident, matmul):
    """Whichever GEMM a prompt's bf16 rows run (LoadOptions.matmul: the CPU decides under auto), a streamed run is
    bitwise the resident one; the two GEMMs differ from each other by rounding only."""
    _, _, resident_bytes, expert, spec = resident
    with sluice.load(model_dir, memory="all", matmul=matmul) as m:
        # the resident store keeps its bf16 experts packed under bf16 GEMMs where the CPU allows (matmul.packable),
        # plain stacks otherwise; the streamed run multiplies its slots with F.linear either way
        assert bool(m.store.packed) == (matmul == "bf16" and packable(*m.layout.gate_up_shape))
        assert bool(m.store.gate_up) != bool(m.store.packed)
        want = m.logits(LONG)
    with sluice.load(model_dir, memory=resident_bytes + spec.top_k * expert, io="direct", matmul=matmul) as m:
        assert m.prefill_chunk >= len(LONG)
        got = m.logits(LONG)
    assert torch.equal(got, want)
    other = resident[0]  # auto's run: one of the two modes
    assert (want - other).norm() <= 3e-2 * other.norm()


def _rows_independent(spec) -> bool:
    """Whether this CPU's bf16 GEMM gives a row the same bits in a block of 75 rows and of 80 (the padding below):
    oneDNN's choice of kernel per row count is the CPU's, so it is asked, not assumed."""
    g = torch.Generator().manual_seed(1)
    out = True
    for n_out, n_in in ((2 * spec.moe_intermediate_size, spec.hidden_size),
                        (spec.hidden_size, spec.moe_intermediate_size)):
        x = torch.randn(80, n_in, generator=g).bfloat16()
        w = torch.randn(n_out, n_in, generator=g).bfloat16()
        out &= torch.equal(torch.nn.functional.linear(x[:75], w), torch.nn.functional.linear(x, w)[:75])
    return out


@pytest.mark.parametrize("memory", ["all", "stream"])
def test_padding_the_gemm_rows_changes_no_bits(model_dir, resident, memory, monkeypatch):
    """Under bf16 GEMMs an expert's 16+ rows run padded to a multiple of experts.GEMM_ROW_STEP (oneDNN builds kernels
    per row count). Where this CPU's GEMM gives a row the same bits whatever the row count (_rows_independent: here,
    a 2-core AVX512_BF16 EPYC), the logits are bitwise those of unpadded rows; elsewhere (another kernel per row
    count) they differ by the GEMM's rounding only. Streamed and resident runs pad alike, so they agree either way
    (test_streamed_prefill_is_the_resident_bits_with_either_matmul)."""
    _, _, resident_bytes, expert, spec = resident
    budget = "all" if memory == "all" else resident_bytes + spec.top_k * expert
    prompt = LONG[:300]  # ~75 rows per expert (8 experts, top 2): padded
    out, rows, step_in_use = [], [], moe.GEMM_ROW_STEP
    call = experts.GluMath.__call__
    for step in (step_in_use, 1):
        monkeypatch.setattr(moe, "GEMM_ROW_STEP", step)
        with sluice.load(model_dir, memory=budget, matmul="bf16") as m:
            seen: list[int] = []
            monkeypatch.setattr(experts.GluMath, "__call__",
                                lambda self, batch, j, x: (seen.append(x.shape[0]), call(self, batch, j, x))[1])
            out.append(m.logits(prompt))
        rows.append(seen)
    padded, plain = rows
    assert step_in_use > 1 and all(n % step_in_use == 0 for n in padded if n >= 16)
    assert any(n % step_in_use for n in plain if n >= 16)  # the padding did change some row counts
    if _rows_independent(spec):
        assert torch.equal(out[0], out[1])
    else:
        torch.testing.assert_close(out[0], out[1], rtol=0.02, atol=0.02 * out[1].abs().max().item())


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe", "qwen4_exp"])
def test_a_span_runs_layer_by_layer_with_the_same_bits_and_one_read(tmp_path, arch):
    """A streamed prompt longer than a chunk runs layer by layer over its span (Transformer.forward_layers): every
    chunk's operations as pass after pass (KV positions, Gated DeltaNet states, PLE history carried chunk to chunk
    within each layer), so the same bits; and with slots for one layer's experts each touched expert is read once,
    where pass after pass reads it again for every chunk."""
    model = hf_model(arch, torch.bfloat16, max_position_embeddings=4096)
    path = write_checkpoint(model, tmp_path, "per_expert" if arch == "qwen3_moe" else None)
    ids = LONG[:400]  # within the tiny hybrids' 512 positions
    with sluice.load(path, memory="all") as m:
        memory = m.resident_bytes + m.spec.num_experts * m.layout.expert_nbytes  # one layer's experts
    got = {}
    for span in (0, len(ids)):
        with sluice.load(path, memory=memory, io="direct", prefill_chunk=96) as m:
            assert m.prefill_span > m.prefill_chunk  # streamed: the plan gives a span
            m.prefill_span = span
            touched: set[tuple[int, int]] = set()
            acquire = m.store.acquire
            m.store.acquire = lambda L, e: (touched.update((L, x) for x in e), acquire(L, e))[1]
            logits = m.logits(ids)
            misses = m.stats()["misses"]
            tokens = list(m.generate_tokens(ids, max_tokens=4))
            got[span] = logits, tokens, misses, len(touched)
    (a, ta, miss_a, _), (b, tb, miss_b, touched) = got[0], got[len(ids)]
    assert torch.equal(a, b) and ta == tb
    assert miss_b == touched < miss_a  # layer by layer each touched expert once; pass after pass, again


def test_auto_memory_leaves_a_streamed_prompt_passes_of_streamed_prompt_tokens(model_dir, resident, monkeypatch):
    """`--memory auto` streaming with `--prefill-chunk auto`: the budget leaves the chunk room for
    STREAMED_PROMPT_TOKENS tokens (at most max_context) where it can, so the passes are not the floor's 256."""
    from sluice.store.budget import STREAMED_PROMPT_TOKENS

    _, _, resident_bytes, expert, spec = resident
    assert STREAMED_PROMPT_TOKENS == 1024
    # the tiny model's experts are a few KiB: a 24-token floor stands in for the 1024 so that streaming and the room
    # for the passes fit together; PREFILL_MIN (256) is the chunk's own floor
    monkeypatch.setattr("sluice.plan.STREAMED_PROMPT_TOKENS", 24)
    opts = dict(memory="auto", io="direct", odirect=True, max_context=32)
    p = _plan(model_dir, monkeypatch, 2**40, memory="all", max_context=32)
    total = p.layout.total_experts
    room = resident_bytes + (total - 1) * expert + p.kv_bytes + RUNTIME_RESERVE  # streams, one expert short
    got = _plan(model_dir, monkeypatch, room, **opts)
    per_token = prefill_token_bytes(got.spec, 2, got.max_context)
    assert got.memory is not None and got.memory_plan.prompt >= 24 * per_token
    assert got.memory == room - p.kv_bytes - RUNTIME_RESERVE - got.memory_plan.prompt
    explicit = _plan(model_dir, monkeypatch, room, prefill_chunk=16, **opts)
    assert explicit.memory_plan.prompt == 0 and explicit.prefill_chunk == 16
