"""qwen4_exp (Qwen3.8-Flash-Next) from Hugging Face folders, beyond the shared parity runner (test_parity.py's
24-token prompts): prompts with end-of-sequence tokens inside them and longer than QSA's budget, in one pass and in
chunks; greedy generation; the n-gram tables read by rows (mmap, direct) bitwise equal to resident, and the rows a
prompt reads counted against transformers' own lookups; streamed experts; the decode state's bytes; the plan's
choice of the tables' mode; the checks on tables, hash numbers and config."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import sluice
from sluice.commands.inspect import _print, describe
from sluice.errors import CheckpointError, ConfigError
from sluice.host.memory import MemoryRoom
from sluice.models import model_args, ngram
from sluice.models.layers import hyper
from sluice.models.tables import ple_tables
from sluice.options import LoadOptions
from sluice.plan import open_index, plan
from sluice.tools.synth import SynthConfig, make_model
from tests.quant.streaming import assert_streamed_equals_resident

from .tiny import TINY

TEXT = TINY["qwen4_exp"]["text_config"]
EOS = TEXT["eos_token_id"]


def _prompt(n: int, seed: int, eos_at: tuple[int, ...]) -> list[int]:
    """n random ids with the end-of-sequence id exactly at `eos_at`."""
    ids = torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    ids = [EOS + 1 if i == EOS else i for i in ids]
    for at in eos_at:
        ids[at] = EOS
    return ids


# 150 tokens: ~37 blocks of 4 where a query keeps 4 (QSA drops most keys), end-of-sequence twice in a row and once
# alone (the n-grams restart after each)
LONG = _prompt(150, 31, (40, 41, 97))
SHORT = LONG[:24]
FP32_REL = 1e-4  # relative to the largest logit


def reference(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out - ref).abs().max().item() / ref.abs().max().item()


@pytest.mark.parametrize("layout", ["per_expert", "fused"])  # the table in 3 shards / saved whole
def test_fp32_logits_match_transformers_past_the_budget_and_across_eos(checkpoints, layout):
    folder, model = checkpoints("qwen4_exp", torch.float32, layout)
    assert len(ple_tables(open_index(folder), plan(folder, LoadOptions()).spec)[0]) == (3 if layout == "per_expert"
                                                                                      else 1)
    for ids in (SHORT, LONG):
        want = reference(model, ids)
        for chunk in ("auto", 50, 7):  # one pass; passes that split QSA's blocks and the n-gram context
            with sluice.load(folder, prefill_chunk=chunk) as m:
                got = m.logits(ids)
            assert rel_err(got, want) <= FP32_REL, (len(ids), chunk, rel_err(got, want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_hyper_connections_in_row_slices_give_the_same_bits(checkpoints, monkeypatch, dtype):
    """A prompt longer than HC_SLICE mixes and injects its streams slice by slice (hyper.py; 150 rows in 10 slices of
    15 here): the logits of the whole prompt at once up to the order a GEMM sums a row in, which may change with the
    row count (float32: 2.2e-7 of the largest logit on the development VM; bf16: equal there, a rounding flipped
    elsewhere may carry further)."""
    folder, _ = checkpoints("qwen4_exp", dtype)
    with sluice.load(folder) as m:
        whole = m.logits(LONG)
        monkeypatch.setattr(hyper, "HC_SLICE", 16)
        calls = []
        mix = hyper.HyperConnection._mix
        monkeypatch.setattr(hyper.HyperConnection, "_mix", lambda self, x: calls.append(len(x)) or mix(self, x))
        sliced = m.logits(LONG)
    assert calls and max(calls) == 15 and set(calls) == {15}
    assert rel_err(sliced, whole) <= (1e-6 if dtype is torch.float32 else 1e-2)


def test_the_long_prompt_drops_keys_and_its_eos_tokens_matter(checkpoints):
    """The parity above means something: QSA leaves keys out of LONG's attention, and moving an end-of-sequence
    token changes the logits after it (the n-grams restart there) in both sluice and transformers."""
    folder, model = checkpoints("qwen4_exp")
    with sluice.load(folder) as m:
        mixer = m.model.layers[1].mixer
        masks, select = [], mixer.select
        mixer.select = lambda x, step: masks.append(select(x, step)) or masks[-1]
        base = m.logits(LONG)
        mask = masks[0]
        causal = torch.ones(len(LONG), len(LONG), dtype=torch.bool).tril()
        assert mask is not None and (mask <= causal).all() and (mask.sum(1) < causal.sum(1)).sum() > 100
        moved = LONG[:97] + [LONG[98], EOS] + LONG[99:]
        other = m.logits(moved)
    # the rows before the move are the same numbers (not bitwise: the experts' row blocks change shape)
    assert rel_err(other[:97], base[:97]) < 1e-6 and rel_err(other[99:], base[99:]) > 1e-3
    assert rel_err(other, reference(model, moved)) <= FP32_REL


def test_greedy_tokens_after_a_long_prompt_equal_transformers(checkpoints):
    folder, model = checkpoints("qwen4_exp")
    ids = LONG[:100]
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    for ple in ("resident", "direct"):
        with sluice.load(folder, prefill_chunk=40, ple=ple) as m:  # the prompt in three passes, 15 decode steps
            out = list(m.generate_tokens(ids, max_tokens=16, stop_at_eos=False))
        assert out == ref[0, len(ids):].tolist(), ple


@pytest.mark.parametrize("chunk", ["auto", 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tables_read_by_rows_give_bitwise_the_resident_logits(checkpoints, dtype, chunk):
    folder, _ = checkpoints("qwen4_exp", dtype)
    with sluice.load(folder, ple="resident", prefill_chunk=chunk) as m:
        want = m.logits(LONG)
        tokens = list(m.generate_tokens(LONG[:60], max_tokens=6, stop_at_eos=False))
    for io, ple, odirect in (("direct", "direct", False), ("direct", "direct", True), ("mmap", "mmap", False),
                             ("mmap", "direct", False), ("direct", "mmap", False), ("willneed", "mmap", False)):
        with sluice.load(folder, io=io, ple=ple, odirect=odirect, prefill_chunk=chunk) as m:
            assert m.load_plan.ple == ple and all(t.mode == ple for t in m.tables.values())
            assert torch.equal(m.logits(LONG), want), (io, ple, odirect)
            assert list(m.generate_tokens(LONG[:60], max_tokens=6, stop_at_eos=False)) == tokens
            assert m.stats()["ple_bytes_read"] > 0


def _distinct_rows(model, ids: list[int]) -> int:
    """The distinct table rows transformers' own n-gram lookups read for `ids`, summed over the PLE layers."""
    seen = []
    lm = model.model.language_model
    hooks = [layer.ple.ple_embedding.ngram_embedding.register_forward_hook(
        lambda mod, args, out: seen.append(torch.unique(args[0]).numel())) for layer in lm.layers
        if layer.ple is not None]
    try:
        reference(model, ids)
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == len(TEXT["ple_layer_ids"])
    return sum(seen)


@pytest.mark.parametrize("ple", ["resident", "mmap", "direct"])
def test_ple_rows_are_the_distinct_rows_of_the_prompt(checkpoints, ple):
    folder, model = checkpoints("qwen4_exp")
    want = _distinct_rows(model, LONG)
    heads = 2 * TEXT["heads_per_ngram"]
    assert want < len(LONG) * heads * 2  # repeated n-grams share rows: dedup is measured
    with sluice.load(folder, ple=ple) as m:
        m.logits(LONG)
        st = m.stats()
        row_bytes = next(iter(m.tables.values())).row_bytes
    assert st["ple"] == ple and st["ple_rows"] == want
    if ple != "resident":
        assert st["ple_bytes_read"] == want * row_bytes and st["ple_wait_s"] > 0
    # decode: each step reads its token's rows (one per head and PLE layer, all distinct: the heads' parts differ)
    with sluice.load(folder, ple=ple) as m:
        list(m.generate_tokens(LONG[:60], max_tokens=4, stop_at_eos=False))
        assert m.stats()["ple_rows"] == _distinct_rows(model, LONG[:60]) + 3 * heads * 2


@pytest.mark.parametrize("io", ["mmap", "direct"])
def test_streamed_rows_have_their_own_pool_of_row_workers(checkpoints, io):
    """--ple direct reads rows through the tables' own pool of ROW_WORKERS (never queued behind expert reads),
    whatever the experts' reader; --io-workers sets it; --ple mmap shares the model's mapping when it has one."""
    from sluice.io import ROW_WORKERS

    folder, _ = checkpoints("qwen4_exp")
    with sluice.load(folder, ple="direct", io=io) as m:
        reader = next(iter(m.tables.values())).reader
        assert reader is not m.reader and reader.mode == "direct" and reader.workers == ROW_WORKERS
    with sluice.load(folder, ple="direct", io_workers=3) as m:
        assert next(iter(m.tables.values())).reader.workers == 3 == m.reader.workers
    with sluice.load(folder, ple="mmap", io=io) as m:
        reader = next(iter(m.tables.values())).reader
        assert reader.mode == "mmap" and (reader is m.reader) == (io == "mmap")


@pytest.mark.parametrize("io,odirect", [("mmap", False), ("direct", False), ("direct", True)])
def test_streamed_experts_equal_resident_bitwise(checkpoints, io, odirect):
    folder, _ = checkpoints("qwen4_exp", torch.bfloat16)
    assert_streamed_equals_resident(folder, LONG[:80], io, odirect, "min", ple="direct")


def test_the_state_holds_keys_indexer_keys_and_the_ple_history(checkpoints, capsys):
    folder, _ = checkpoints("qwen4_exp", torch.bfloat16)
    p = plan(folder, LoadOptions(max_context=200))
    s, d = p.spec, p.spec.delta
    attends = [s.attends(L) for L in range(s.n_layers)]
    kv = (2 * s.n_kv_heads * s.head_dim + TEXT["indexer_head_dim"]) * 2  # keys, values, the raw indexer key (bf16)
    delta = d.conv_dim * (d.conv_kernel - 1) * 2 + 4 * d.n_v_heads * d.k_head_dim * d.v_head_dim
    ple = 8 * 2 + 3 * 64 * (3 - 1) * 3 * 2  # the last two ids; the conv's last (K - 1) * ngram_size inputs of 3 x 64
    want = sum(attends) * 200 * kv + (s.n_layers - sum(attends)) * delta + 2 * ple
    assert p.kv_bytes == want
    info = describe(p)
    primes = ngram.primes_from(101, 8)  # two tables of 4 prime parts each: 101 ... 109, then 113 ... 137
    rows = ngram.padded_rows(primes[:4], 16) + ngram.padded_rows(primes[4:], 16)
    assert rows == 432 + 512
    assert info["ple"] == {"mode": "resident", "why": info["ple"]["why"], "bytes": rows * 8 * 2, "layers": [0, 2],
                           "parts": 6, "rows": rows, "rows_per_token": 8, "row_bytes": 16, "dtype": "BF16"}
    assert info["residual_streams"] == 3 and info["qsa"]["budget"] == 16
    _print(info)
    out = capsys.readouterr().out
    assert "n-gram tables (PLE) on layers [0, 2]" in out and "8 rows per token" in out and "read: resident" in out
    with sluice.load(folder, max_context=200) as m:
        held = sum(t.nbytes for c in m.cache.layers for t in vars(c).values() if isinstance(t, torch.Tensor))
        assert held == m.cache.nbytes == want
        assert [c.index_keys is not None for c in m.cache.layers] == attends
        assert [c.ple_ids is not None for c in m.cache.layers] == [True, False, True, False]


def test_auto_reads_the_tables_by_rows_when_they_do_not_fit_beside_the_budget(checkpoints, monkeypatch):
    folder, _ = checkpoints("qwen4_exp")
    p0 = plan(folder, LoadOptions(memory="all", max_context=64))
    kept = p0.resident_bytes + p0.layout.total_experts * p0.layout.expert_nbytes
    monkeypatch.setattr("sluice.plan.memory_status", lambda: {"rss_anon_bytes": 2**40})  # the reserve is held
    for room, mode in ((kept + p0.kv_bytes + p0.ple_bytes, "resident"), (kept + p0.kv_bytes + p0.ple_bytes - 1,
                                                                         "direct")):
        monkeypatch.setattr("sluice.plan.available_memory", lambda: MemoryRoom(room, "test room"))
        p = plan(folder, LoadOptions(memory="all", max_context=64))
        assert (p.ple, p.ple_why.startswith("auto: ")) == (mode, True), p.ple_why
    assert plan(folder, LoadOptions(memory="all", max_context=64, ple="mmap")).ple_why == "--ple mmap"


def _copy(folder, tmp_path, **text):
    """A copy of the checkpoint folder with config.json's text_config changed."""
    out = shutil.copytree(folder, tmp_path / "copy")
    cfg = json.loads((out / "config.json").read_text())
    cfg["text_config"].update(text)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_a_table_or_hash_of_another_config_is_refused(checkpoints, tmp_path):
    folder, _ = checkpoints("qwen4_exp")
    with pytest.raises(CheckpointError, match=r"n-gram table has 432 rows in 3 part\(s\), but config.json describes "
                                              "512"):
        plan(_copy(folder, tmp_path, make_ngram_vocab_size_divisible_by=128), LoadOptions())
    # another seed hashes into the same rows at other places: only the saved multipliers tell
    with pytest.raises(CheckpointError, match="layer_multipliers'.* where config.json gives .*the table was hashed "
                                              "with other numbers"):
        sluice.load(_copy(folder, tmp_path / "b", seed=8))


class _Index(dict):
    folder = "/m"


def test_table_parts_must_be_a_whole_sequence(checkpoints):
    folder, _ = checkpoints("qwen4_exp")
    p = plan(folder, LoadOptions())
    real = open_index(folder)
    name = "model.layers.0.ple.ple_embedding.ngram_embedding"
    tables = _Index({n: real[n] for n in real if n.startswith("model.layers.2.")})
    shards = _Index({n: real[n] for n in real})
    with pytest.raises(CheckpointError, match=f"tensor '{name}.weight': missing"):
        ple_tables(tables, p.spec)
    del shards[f"{name}.shard_1.weight"]
    with pytest.raises(CheckpointError, match=f"tensor '{name}.shard_1.weight': shard 1 of 3 is missing"):
        ple_tables(shards, p.spec)
    shards[f"{name}.shard_1.weight"] = shards[f"{name}.weight"] = real[f"{name}.shard_0.weight"]
    with pytest.raises(CheckpointError, match="holds both .* and 3 shards of it: keep one"):
        ple_tables(shards, p.spec)


def test_a_pass_that_does_not_continue_the_ple_history_is_refused(checkpoints):
    folder, _ = checkpoints("qwen4_exp")
    with sluice.load(folder) as m:
        m.logits(LONG[:30])
        with pytest.raises(RuntimeError, match="PLE block holds the history of 30 tokens and cannot continue at "
                                               "position 20"):
            m.model.forward(torch.tensor(LONG[20:25]), 20)


@pytest.mark.parametrize("change,field", [
    (dict(ple_layer_ids=[2]), "ple_layer_ids"),  # an attending layer
    (dict(indexer_budget=None), "indexer_budget"),  # QSA needs all its fields
    (dict(indexer_kv_heads=2), "indexer_kv_heads"),
    (dict(indexer_budget=18), "indexer_budget"),  # not whole blocks of 4
    (dict(indexer_head_dim=6), "indexer_head_dim"),  # 8 rotary dims do not fit
    (dict(hc_count=1), "hc_count"),
    (dict(ple_embed_dim=30), "ple_embed_dim"),  # 4 heads do not divide it
    (dict(eos_token_id=None), "eos_token_id"),  # PLE's n-grams restart after it
    (dict(output_gate_type="gelu"), "output_gate_type"),
])
def test_config_errors_name_the_field(change, field):
    cfg = {"model_type": "qwen4_exp", "text_config": {**TEXT, **change}}
    with pytest.raises(ConfigError, match=f"field '{field}'"):
        model_args(cfg)


# a GGUF's numbers for one PLE layer of TEXT's 4 heads (models/qwen4_exp.py GGUF: llama.cpp's ple.* metadata)
GGUF_HASH = dict(ple_layer_ids=[1], ple_multipliers=[3, 5, 7], ple_head_sizes=[101, 103, 107, 109],
                 ple_head_offsets=[0, 101, 204, 311], ple_table_rows=420, ple_eos_token_id=9, eos_token_id=None)


def test_a_ggufs_hash_numbers_make_the_spec():
    _, args = model_args({"model_type": "qwen4_exp", "text_config": {**TEXT, **GGUF_HASH}})
    p = args.spec().ple
    assert (p.layers, p.multipliers, p.head_sizes, p.offsets, p.rows, p.eos_token_id) == (
        [0], [[3, 5, 7]], [[101, 103, 107, 109]], [[0, 101, 204, 311]], [420], 9)


@pytest.mark.parametrize("change,field", [
    (dict(ple_table_rows=None), "ple_table_rows"),  # all or none
    (dict(ple_layer_ids=[1, 3]), "ple_layer_ids"),  # the numbers of one layer
    (dict(ple_multipliers=[3, 5]), "ple_multipliers"),  # one per n-gram position
    (dict(ple_head_offsets=[0, 101, 204]), "ple_head_sizes"),  # one per head
    (dict(ple_multipliers=[3, 5, 2**62]), "ple_multipliers"),  # t * m leaves int64
    (dict(ple_table_rows=419), "ple_table_rows"),  # the last head ends at row 419
    (dict(ple_eos_token_id=None), "eos_token_id"),
])
def test_a_ggufs_hash_numbers_are_checked(change, field):
    with pytest.raises(ConfigError, match=f"field '{field}'"):
        model_args({"model_type": "qwen4_exp", "text_config": {**TEXT, **GGUF_HASH, **change}})


def test_without_indexer_fields_the_attending_layers_are_plain_gated_attention():
    text = {k: v for k, v in TEXT.items() if not k.startswith("indexer_")}
    _, args = model_args({"model_type": "qwen4_exp", "text_config": text})
    assert args.spec().qsa is None


def test_hash_numbers_equal_transformers():
    from transformers.models.qwen4_exp import modeling_qwen4_exp as ref

    for vocab, n, index, seed in ((300, 3, 0, 7), (248320, 3, 1, 1234), (2**31 - 1, 5, 3, 0)):
        assert ngram.multipliers(vocab, n, index, seed) == ref._build_layer_multipliers(vocab, n, index, seed).tolist()
    for base in (101, 20_000_000):
        assert ngram.primes_from(base, 6) == [ref._find_nth_prime_after(base - 1, k + 1) for k in range(6)]


def test_make_model_writes_the_tables_at_the_size_asked(tmp_path):
    sc = SynthConfig(arch="qwen4_exp", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     num_experts=4, top_k=2, moe_intermediate_size=32, vocab_size=300, ple_bytes=4 * 2**20)
    folder = make_model(tmp_path / "m", sc, progress=False)
    p = plan(folder, LoadOptions(ple="direct"))
    assert abs(p.ple_bytes / 2**22 - 1) < 0.01 and len(p.ple_tables[0]) == 4
    with sluice.load(folder, ple="direct") as m:
        m.logits([5, 17, 3, 250, 42])
        assert 0 < m.stats()["ple_rows"] <= 5 * 16
    with pytest.raises(ConfigError, match="qwen3_moe has no n-gram embedding tables"):
        SynthConfig(arch="qwen3_moe", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    num_experts=4, top_k=2, moe_intermediate_size=32, vocab_size=300, ple_bytes=2**20)


def test_make_model_cli_writes_the_tables_and_inspect_and_run_report_them(tmp_path, capsys):
    from sluice import cli

    out = tmp_path / "q4"
    rc = cli.main(["make-model", str(out), "--arch", "qwen4_exp", "--size", "8MiB", "--layers", "4", "--hidden", "64",
                   "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--experts", "8", "--top-k", "2",
                   "--ple-size", "6MiB", "--no-progress"])
    assert rc == 0 and "n-gram tables 6.0" in capsys.readouterr().out
    text = json.loads((out / "config.json").read_text())["text_config"]
    assert (text["model_type"], text["ple_layer_ids"], text["hc_count"]) == ("qwen4_exp_text", [1], 4)
    assert cli.main(["inspect", str(out), "--usage-tokens", "0", "--json", "--ple", "direct"]) == 0
    ple = json.loads(capsys.readouterr().out)["ple"]
    assert (ple["mode"], ple["why"], ple["rows_per_token"], ple["layers"]) == ("direct", "--ple direct", 16, [0])
    assert abs(ple["bytes"] / (6 * 2**20) - 1) < 0.01 and ple["parts"] == 4
    assert cli.main(["run", str(out), "--prompt", "hello there", "--max-tokens", "3", "--ple", "mmap", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)["stats"]
    assert st["ple"] == "mmap" and st["ple_rows"] > 0 and st["ple_bytes_read"] == st["ple_rows"] * 8
    assert cli.main(["make-model", str(tmp_path / "x"), "--arch", "qwen3_moe", "--size", "8MiB", "--ple-size",
                     "1MiB"]) == 2
    err = capsys.readouterr().err
    assert "qwen3_moe has no n-gram embedding tables (those that do: qwen4_exp)" in err and len(err.splitlines()) == 1
