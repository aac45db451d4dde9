"""`sluice export-gguf` / `sluice quantize` of the Gated DeltaNet hybrids (qwen3_next -> qwen3next, qwen3_5_moe ->
qwen35moe): the file reads back as the checkpoint (sluice's GGUF facts, the reader's side of tools/gguf_hybrid.py),
holds what llama.cpp's own converter writes of the same checkpoint, tensor for tensor and key for key, and llama.cpp
runs it to transformers' greedy tokens. Checkpoints llama.cpp's graphs cannot run are refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

import sluice  # noqa: E402
from sluice import cli  # noqa: E402
from sluice.plan import open_index  # noqa: E402
from sluice.tools.gguf_export import ExportError, export_gguf  # noqa: E402
from sluice.tools.quantize import quantize  # noqa: E402
from tests.checkpoint import llama_cpp  # noqa: E402
from tests.checkpoint.hybrid_files import GGUF_ARCH, LLAMA_TINY, LONG, SHORT, hf_folder  # noqa: E402


@pytest.fixture(scope="module", params=list(GGUF_ARCH))
def exported(request, tmp_path_factory):
    """(arch, transformers model, HF folder, sluice's F32 export of it)."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    folder, model = hf_folder(arch, root, **LLAMA_TINY[arch])
    out = root / "sluice-f32.gguf"
    export_gguf(folder, out, "f32")
    return arch, model, folder, out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out - ref).abs().max().item() / ref.abs().max().item()


def test_the_export_reads_back_as_the_checkpoint(exported):
    arch, model, folder, path = exported
    index = open_index(path)
    assert index.arch == GGUF_ARCH[arch]
    with sluice.load(folder, dtype="float32") as m:
        want = m.logits(LONG)
    with sluice.load(path, dtype="float32") as m:  # norms (w + 1) - 1 and log(exp(A_log)): to float32 rounding
        assert rel_err(m.logits(LONG), want) <= 1e-5
    with torch.no_grad():
        assert rel_err(want, model(torch.tensor([LONG])).logits[0]) <= 1e-4


def test_inspect_and_run_the_gguf(exported, capsys):
    """`sluice inspect` and `sluice run` on the file: the hybrid's layers and state, the tokenizer from its metadata."""
    arch, _, _, path = exported
    capsys.readouterr()
    assert cli.main(["inspect", str(path), "--usage-tokens", "0", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["model_type"], info["attention"]) == (arch, "hybrid") and 0 < info["kv_layers"] < info["layers"]
    assert cli.main(["run", str(path), "--prompt", "hello world", "--max-tokens", "4", "--temperature", "0",
                     "--json"]) == 0
    ran = json.loads(capsys.readouterr().out)
    assert 1 <= len(ran["tokens"]) <= 4 and isinstance(ran["text"], str)


def _tensors(path) -> dict[str, tuple[str, np.ndarray]]:
    return {t.name: (t.tensor_type.name, np.array(t.data)) for t in gguf.GGUFReader(path).tensors}


def _arch_keys(path, arch: str) -> dict:
    f = gguf.GGUFReader(path).fields
    return {k: f[k].contents() for k in f if k.startswith(f"{arch}.")}


@pytest.mark.llama_cpp
def test_the_export_holds_what_llama_cpps_converter_writes(exported, tmp_path):
    """Tensor for tensor (names, types, shapes, values bit for bit: the same float32 maps and permutations) and
    key for key of the architecture's metadata, against convert_hf_to_gguf.py --outtype f32 of the same folder."""
    arch, _, folder, path = exported
    theirs = llama_cpp.convert(folder, tmp_path / "llama-f32.gguf")
    ours, want = _tensors(path), _tensors(theirs)
    assert set(ours) == set(want)
    for name, (kind, values) in want.items():
        assert ours[name][0] == kind and ours[name][1].shape == values.shape, name
        assert np.array_equal(ours[name][1], values), name
    a, b = _arch_keys(path, GGUF_ARCH[arch]), _arch_keys(theirs, GGUF_ARCH[arch])
    assert {k: v for k, v in a.items() if k in b} == b  # every key llama.cpp's converter writes, the same
    assert set(a) - set(b) <= {f"{GGUF_ARCH[arch]}.attention.recurrent_layers"}  # one more: the layer kinds


@pytest.mark.llama_cpp
def test_llama_cpp_runs_sluices_file_to_transformers_tokens(exported):
    arch, model, _, path = exported
    ids = LONG[:100]
    got = llama_cpp.greedy(path, ids, 12)["tokens"]
    with sluice.load(path, dtype="float32") as m:
        assert list(m.generate_tokens(ids, max_tokens=12, stop_at_eos=False)) == got, arch
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert got == want[0, len(ids):].tolist(), arch


@pytest.mark.llama_cpp
def test_sluices_q8_0_is_llama_cpps(exported, tmp_path):
    """`sluice quantize --to q8_0` writes llama.cpp's own Q8_0 file of the checkpoint (its converter's F32 file
    through its quantizer), tensor for tensor, bit for bit: llama.cpp's logits on the two are the same. (The tiny
    model's greedy tokens after 100 tokens move with Q8_0's rounding, so they are not compared with transformers'.)"""
    arch, _, folder, _ = exported
    ours = tmp_path / "sluice-q8_0.gguf"
    quantize(folder, ours, "q8_0")
    theirs = llama_cpp.quantize(llama_cpp.convert(folder, tmp_path / "llama-f32.gguf"), tmp_path / "llama-q8_0.gguf",
                                "Q8_0")
    a, b = _tensors(ours), _tensors(theirs)
    assert set(a) == set(b)
    for name, (kind, values) in b.items():  # (its quantizer drops a trailing 1 of a shape: the gate [1, H] as [H])
        assert a[name][0] == kind and np.array_equal(a[name][1].reshape(-1), values.reshape(-1)), name
    ids = LONG[:100]
    assert llama_cpp.greedy(ours, ids, 8) == llama_cpp.greedy(theirs, ids, 8), arch


@pytest.mark.parametrize("arch,overrides,needle", [
    ("qwen3_next", dict(linear_value_head_dim=12, mlp_only_layers=[], norm_topk_prob=True),
     "linear_key_head_dim 8 differs from linear_value_head_dim 12"),
    ("qwen3_next", dict(linear_value_head_dim=8, norm_topk_prob=True), "dense layers are not supported"),
    ("qwen3_next", dict(linear_value_head_dim=8, mlp_only_layers=[]), "norm_topk_prob is false"),
    ("qwen4_exp", {}, "writes no hyper-connections, QSA indexer or n-gram tables; convert the folder with llama.cpp"),
])
def test_what_llama_cpps_graphs_cannot_run_is_refused(tmp_path, arch, overrides, needle):
    folder, _ = hf_folder(arch, tmp_path, **overrides)
    with pytest.raises(ExportError, match=needle):
        export_gguf(folder, tmp_path / "m.gguf", "f32")
    assert not (tmp_path / "m.gguf").exists()


def test_quantized_export_reads_back(exported, tmp_path):
    """`sluice quantize --to q8_0` of a hybrid: the 2-D projections in Q8_0, each value within Q8_0's rounding of
    the F32 export's (the same maps and head order), the conv, norms, decay parameters and the shared expert gate in
    F32 (as llama.cpp keeps them) and equal to it; sluice reads the file as the model, within Q8_0's error."""
    _, _, folder, f32 = exported
    out = tmp_path / "m-q8_0.gguf"
    quantize(folder, out, "q8_0")
    q8, exact = {t.name: t for t in gguf.GGUFReader(out).tensors}, _tensors(f32)
    assert {n: q8[n].tensor_type.name for n in ("blk.0.ssm_conv1d.weight", "blk.0.ssm_a", "blk.0.ssm_out.weight",
                                                "blk.0.ffn_gate_inp_shexp.weight")} == \
        {"blk.0.ssm_conv1d.weight": "F32", "blk.0.ssm_a": "F32", "blk.0.ssm_out.weight": "Q8_0",
         "blk.0.ffn_gate_inp_shexp.weight": "F32"}
    for name, t in q8.items():
        want = exact[name][1]
        if t.tensor_type.name != "Q8_0":  # F32, or F16 where rows are no whole number of blocks (llama.cpp's rule)
            data = np.array(t.data)
            assert np.array_equal(data, want.astype(data.dtype)), name
            continue
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1, 32)
        blocks = want.reshape(-1, 32)
        step = np.abs(blocks).max(axis=1, keepdims=True) / 127  # its scale; half a step, plus the f16 scale's rounding
        assert (np.abs(got - blocks) <= 0.6 * step + 1e-12).all(), name
    with sluice.load(f32, dtype="float32") as m:
        want = m.logits(SHORT)
    with sluice.load(out, dtype="float32") as m:
        got = m.logits(SHORT)
    assert ((got - want).norm() / want.norm()).item() <= 5e-2  # this tiny model moves ~2% with Q8_0's rounding


def test_grouped_decode_projections_are_the_separate_calls_bitwise(exported, tmp_path):
    """A decode token's Gated DeltaNet input projections kept in Q8_0 run as one native call (x quantized once:
    GatedDeltaNet.in_group); its outputs, and so the generated tokens' logits, are bitwise those of one call per
    projection."""
    from sluice.models.layers.gated_deltanet import GatedDeltaNet

    _, _, folder, _ = exported
    out = tmp_path / "m-q8_0.gguf"
    quantize(folder, out, "q8_0")
    runs = []
    for grouped in (True, False):
        with sluice.load(out) as m:
            mixers = [layer.mixer for layer in m.model.layers if isinstance(layer.mixer, GatedDeltaNet)]
            assert mixers and all(x.in_group is not None for x in mixers)
            if not grouped:
                for x in mixers:
                    x.in_group = None
            tm = m.model  # teacher-forced decode steps, each token alone (the grouped call's case)
            with torch.inference_mode():
                tm.forward(torch.tensor(SHORT), 0)
                runs.append(torch.cat([tm.logits(tm.forward(torch.tensor([t]), p))
                                       for p, t in enumerate(LONG[:6], len(SHORT))]))
    assert torch.equal(runs[0], runs[1])
