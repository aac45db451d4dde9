"""qwen4_exp (Qwen3.8-Flash-Next) as llama.cpp's converter writes it (`qwen4exp`): convert_hf_to_gguf.py on tiny
random transformers checkpoints (tests/checkpoint/qwen4_files.py), then sluice on the GGUF against transformers (F32:
the converter's renames, +1 norms, -exp(A_log), squeezed convs, tiled value heads and split indexer projection
undone; the n-gram table read by rows from the file, its hash from the metadata), against llama.cpp's greedy tokens
(its F32 file and its own Q8_0), the table read by rows (mmap, direct) bitwise equal to resident, and tables stored
in other types giving their own dequantization's logits. Then `inspect`, and the errors for a bad file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import sluice
from sluice.checkpoint.gguf_index import GGUFIndex
from sluice.errors import CheckpointError, ConfigError
from sluice.options import LoadOptions
from sluice.plan import open_index, plan
from sluice.quant.tensor import read_tensor
from tests.checkpoint import llama_cpp
from tests.checkpoint.qwen4_files import (LLAMA_TEXT, TABLE, WIDE_TEXT, gguf, gguf_file, retyped_table, rewrite,
                                          table_of, with_ratios)

from .test_qwen4_exp import EOS, FP32_REL, _prompt, reference, rel_err

pytestmark = pytest.mark.llama_cpp
Q, V = gguf.GGMLQuantizationType, gguf.GGUFValueType
RATIO = LLAMA_TEXT["indexer_compress_ratio"]
NGRAM = "model.layers.0.ple.ple_embedding.ngram_embedding.weight"  # the table's name in sluice (the GGUF's TABLE)
# as test_qwen4_exp.py's LONG (past the budget, end-of-sequence inside), of another seed: with its seed this model's
# router is at a near tie on one token of the last layer (transformers' own eager and sdpa paths part there)
LONG = _prompt(150, 32, (40, 41, 97))
SHORT = LONG[:24]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(transformers model, its HF folder, the converter's F32 GGUF, the same with its compress ratios written)."""
    root = tmp_path_factory.mktemp("qwen4exp")
    folder, model, raw = gguf_file(root, LLAMA_TEXT)
    return model, folder, raw, with_ratios(raw, root / "m-f32-qsa.gguf", RATIO)


def test_f32_logits_match_transformers_past_the_budget_and_across_eos(files):
    model, _, _, path = files
    index = open_index(path)
    assert isinstance(index, GGUFIndex) and index.arch == "qwen4exp"
    p = plan(path, LoadOptions(dtype="float32"))
    assert p.spec.qsa.split and p.spec.qsa.compress_ratio == RATIO and p.spec.delta.tiled
    assert p.spec.ple.layers == [0] and p.spec.ple.eos_token_id == EOS != index.config["eos_token_id"]
    assert [r.name for r in p.ple_tables[0]] == [TABLE]
    for ids in (SHORT, LONG):
        want = reference(model, ids)
        for chunk in ("auto", 50, 7):  # one pass; passes that split QSA's blocks and the n-gram context
            with sluice.load(path, dtype="float32", prefill_chunk=chunk) as m:
                got = m.logits(ids)
            assert rel_err(got, want) <= FP32_REL, (len(ids), chunk, rel_err(got, want))


def test_every_tensor_reads_as_transformers_wrote_it(files):
    """The table and the hash numbers are transformers' (the table whole, the buffers from the metadata);
    the norms less the converter's +1; the indexer's two projections stack to index_qk_proj."""
    model, _, _, path = files
    index, spec = open_index(path), plan(path, LoadOptions()).spec
    sd = {k.replace("model.language_model.", "model."): v for k, v in model.state_dict().items()}
    t = "model.layers.0.ple.ple_embedding"
    # the folder holds it in split_ngram_parts shards, which the converter concatenated
    assert torch.equal(read_tensor(index[f"{t}.ngram_embedding.weight"]), sd[f"{t}.ngram_embedding.weight"])
    for role, buf in (("multipliers", "layer_multipliers"), ("sizes", "ngram_heads_vocab_sizes"),
                      ("offsets", "ngram_heads_offsets")):
        got = {"multipliers": spec.ple.multipliers, "sizes": spec.ple.head_sizes, "offsets": spec.ple.offsets}[role]
        assert got == [sd[f"{t}.{buf}"].tolist()], role
    a = "model.layers.1.self_attn.indexer"
    qk = torch.cat([read_tensor(index[f"{a}.q_proj.weight"]), read_tensor(index[f"{a}.k_proj.weight"])])
    assert torch.equal(qk, sd[f"{a}.index_qk_proj.weight"])
    for name in (f"{a}.q_layernorm.weight", "model.layers.0.ple.norm_key.weight", "model.layers.0.ple.norm_conv.weight",
                 "model.layers.2.attn_hyper_connection.hc_norm.weight", "model.hyper_connection_mixer.hc_norm.weight"):
        torch.testing.assert_close(read_tensor(index[name]), sd[name], rtol=1e-6, atol=1e-7, msg=name)  # (w + 1) - 1
    conv = "model.layers.0.ple.conv1d.weight"
    assert torch.equal(read_tensor(index[conv]).reshape(sd[conv].shape), sd[conv])  # squeezed [C, K]


@pytest.mark.parametrize("chunk", ["auto", 37])
def test_the_table_read_by_rows_gives_bitwise_the_resident_logits(files, chunk):
    _, _, _, path = files
    with sluice.load(path, ple="resident", prefill_chunk=chunk) as m:
        want = m.logits(LONG)
        tokens = list(m.generate_tokens(LONG[:60], max_tokens=6, stop_at_eos=False))
    for io, ple, odirect in (("direct", "direct", False), ("direct", "direct", True), ("mmap", "mmap", False),
                             ("mmap", "direct", False)):
        with sluice.load(path, io=io, ple=ple, odirect=odirect, prefill_chunk=chunk) as m:
            assert all(t.mode == ple for t in m.tables.values())
            assert torch.equal(m.logits(LONG), want), (io, ple, odirect)
            assert list(m.generate_tokens(LONG[:60], max_tokens=6, stop_at_eos=False)) == tokens
            st = m.stats()
            assert st["ple_rows"] > 0 and st["ple_bytes_read"] == st["ple_rows"] * 32 * 4  # F32 rows of 32


def test_llama_cpp_greedy_tokens_on_the_f32_file(files):
    """Where the converter wrote no compress ratio (what it writes: qwen4_files.py), llama.cpp and sluice both run
    dense attention; where it did, both run QSA."""
    _, _, raw, path = files
    ids = LONG[:100]
    assert plan(raw, LoadOptions()).spec.qsa is None
    for f in (raw, path):
        ref = llama_cpp.greedy(f, ids, 12)["tokens"]
        with sluice.load(f, dtype="float32") as m:
            assert list(m.generate_tokens(ids, max_tokens=12, stop_at_eos=False)) == ref, f.name


def test_llama_cpps_q8_0_file(files, tmp_path):
    """llama.cpp's own quantizer stores the table as Q8_0 too: sluice reads it by rows and gives llama.cpp's tokens
    (float32: the file's exact dequantization), bitwise the same by rows as resident."""
    _, _, _, path = files
    q8 = llama_cpp.quantize(path, tmp_path / "m-Q8_0.gguf", "Q8_0")
    assert open_index(q8)[NGRAM].dtype == "Q8_0"
    ids = LONG[:100]
    ref = llama_cpp.greedy(q8, ids, 12)["tokens"]
    outs = {}
    for ple in ("resident", "mmap", "direct"):
        with sluice.load(q8, dtype="float32", ple=ple) as m:
            outs[ple] = (m.logits(LONG), list(m.generate_tokens(ids, max_tokens=12, stop_at_eos=False)))
    assert outs["resident"][1] == ref
    assert all(torch.equal(o[0], outs["resident"][0]) and o[1] == ref for o in outs.values())


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """The converter's F32 GGUF of a checkpoint whose table rows are 256 wide (one K-quant block)."""
    root = tmp_path_factory.mktemp("qwen4exp-wide")
    _, _, raw = gguf_file(root, WIDE_TEXT)
    return root, with_ratios(raw, root / "m-f32-qsa.gguf", RATIO)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL"])
def test_a_quantized_table_gives_its_own_dequantizations_logits(wide, qtype):
    root, path = wide
    quant, exact = retyped_table(path, root, Q[qtype])
    ids = LONG[:80]
    with sluice.load(exact, dtype="float32") as m:
        want = m.logits(ids)
    assert open_index(quant)[NGRAM].dtype == qtype
    for ple in ("resident", "mmap", "direct"):
        with sluice.load(quant, dtype="float32", ple=ple) as m:
            assert torch.equal(m.logits(ids), want), (qtype, ple)
            st = m.stats()
        if ple != "resident":  # whole blocks per row
            assert st["ple_bytes_read"] == st["ple_rows"] * open_index(quant)[NGRAM].row_nbytes


def test_inspect_prints_the_table(files, tmp_path, capsys):
    from sluice import cli

    _, _, _, path = files
    q8 = llama_cpp.quantize(path, tmp_path / "m-Q8_0.gguf", "Q8_0")
    assert cli.main(["inspect", str(q8), "--usage-tokens", "0", "--json", "--ple", "direct"]) == 0
    ple = json.loads(capsys.readouterr().out)["ple"]
    ref = open_index(q8)[NGRAM]
    rows, width = ref.shape
    assert (rows, width) == (208, 32)  # primes 101 and 103, padded to 16; 64 / 2 heads
    assert ple == {"mode": "direct", "why": "--ple direct", "bytes": rows * 34, "layers": [0], "parts": 1,
                   "rows": rows, "rows_per_token": 2, "row_bytes": 34, "dtype": "Q8_0"}  # one Q8_0 block per row
    assert cli.main(["inspect", str(q8), "--usage-tokens", "0"]) == 0
    out = capsys.readouterr().out
    assert "n-gram tables (PLE) on layers [0]: 6.9 KiB (208 rows of 34 B, Q8_0, in 1 parts); 2 rows per token" in out


def _error(path, match: str, kind=CheckpointError) -> str:
    with pytest.raises(kind, match=match) as e:
        sluice.load(path)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_files_get_one_error_naming_the_key_or_tensor(files, tmp_path):
    _, _, _, path = files
    for key in ("qwen4exp.ple.layer_multipliers", "qwen4exp.ple.head_vocab_sizes", "qwen4exp.ple.eos_token_id",
                "qwen4exp.embedding_length_per_layer_input"):
        _error(rewrite(path, tmp_path / "a.gguf", drop=(key,)), f"metadata {key} is missing")
    short = {"qwen4exp.ple.head_offsets": ([0], V.ARRAY, V.UINT64)}
    _error(rewrite(path, tmp_path / "b.gguf", meta=short), "metadata qwen4exp.ple.head_offsets must be an array of 2")
    two = {"qwen4exp.ple.layers": ([0, 2], V.ARRAY, V.INT32)}
    _error(rewrite(path, tmp_path / "c.gguf", meta=two), r"ple.layers is \[0, 2\]: a qwen4exp GGUF holds one",
           ConfigError)
    mixed = {"qwen4exp.attention.compress_ratios": ([0, 4, 0, 8], V.ARRAY, V.INT32)}
    _error(rewrite(path, tmp_path / "d.gguf", meta=mixed), r"compress_ratios is \[0, 4, 0, 8\]: sluice runs one",
           ConfigError)
    big = {"qwen4exp.ple.layer_multipliers": ([2**62, 3, 5], V.ARRAY, V.UINT64)}
    _error(rewrite(path, tmp_path / "e.gguf", meta=big), "field 'ple_multipliers'.* leaves int64", ConfigError)
    narrow = {"qwen4exp.embedding_length_per_layer_input": (16, V.UINT32, None)}
    values = table_of(path)
    for bad, what in (
            (rewrite(path, tmp_path / "f.gguf", tensors={TABLE: None}), "missing; metadata qwen4exp.ple.layers puts"),
            (rewrite(path, tmp_path / "g.gguf", meta=narrow), r"of shape \[208, 32\]; .* expected \[rows, "),
            (rewrite(path, tmp_path / "h.gguf", tensors={TABLE: (values[:200], Q.F32)}), "has 200 rows, too few"),
            (rewrite(path, tmp_path / "i.gguf", tensors={TABLE: (np.zeros((208, 40), np.uint8), Q.Q8_1)}),
             "Q8_1 is not supported")):
        assert f"tensor '{TABLE}'" in _error(bad, what)


def test_a_make_model_checkpoint_converts_and_reads_as_the_folder(tmp_path):
    """`make-model --arch qwen4_exp` (the hub's layout: the wrapper, the table in shards, its hash buffers) through
    llama.cpp's converter: the file gives the folder's logits (a prompt inside the QSA budget of 1,024, so the
    compress ratio the converter leaves out changes nothing), and its table is the shards' rows."""
    from sluice.tools.synth import SynthConfig, make_model

    sc = SynthConfig(arch="qwen4_exp", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                     num_experts=4, top_k=2, moe_intermediate_size=32, vocab_size=300, dtype="float32")
    folder = make_model(tmp_path / "m", sc, progress=False)
    path = llama_cpp.convert(folder, tmp_path / "m.gguf", no_mtp=False)
    ids = [5, 17, 3, 250, 2, 42, 42, 7, 2, 2, 99] * 4
    with sluice.load(folder, dtype="float32") as m:
        want = m.logits(ids)
    for ple in ("resident", "direct"):
        with sluice.load(path, dtype="float32", ple=ple) as m:
            assert m.spec.ple.eos_token_id == 2 and m.spec.qsa is None
            assert rel_err(m.logits(ids), want) <= FP32_REL, ple
