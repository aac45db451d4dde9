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
@pytest.mark.parametrize("to", ["f32", "q8_0"])
def test_llama_cpp_runs_sluices_file_to_transformers_tokens(exported, tmp_path, to):
    arch, model, folder, path = exported
    if to != "f32":
        path = tmp_path / f"m-{to}.gguf"
        quantize(folder, path, to)
    ids = LONG[:100]
    got = llama_cpp.greedy(path, ids, 12)["tokens"]
    with sluice.load(path, dtype="float32") as m:
        assert list(m.generate_tokens(ids, max_tokens=12, stop_at_eos=False)) == got, (arch, to)
    if to == "f32":
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                  pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert got == want[0, len(ids):].tolist(), arch


@pytest.mark.parametrize("arch,overrides,needle", [
    ("qwen3_next", dict(linear_value_head_dim=12, mlp_only_layers=[], norm_topk_prob=True),
     "linear_key_head_dim 8 differs from linear_value_head_dim 12"),
    ("qwen3_next", dict(linear_value_head_dim=8, norm_topk_prob=True), "dense layers are not supported"),
    ("qwen3_next", dict(linear_value_head_dim=8, mlp_only_layers=[]), "norm_topk_prob is false"),
])
def test_what_llama_cpps_graphs_cannot_run_is_refused(tmp_path, arch, overrides, needle):
    folder, _ = hf_folder(arch, tmp_path, **overrides)
    with pytest.raises(ExportError, match=needle):
        export_gguf(folder, tmp_path / "m.gguf", "f32")
    assert not (tmp_path / "m.gguf").exists()


def test_quantized_export_reads_back(exported, tmp_path):
    """`sluice quantize --to q8_0` of a hybrid: the 2-D projections in Q8_0, the conv, norms and decay parameters in
    F32 (as llama.cpp keeps them), within Q8_0's error of the checkpoint."""
    _, _, folder, _ = exported
    out = tmp_path / "m-q8_0.gguf"
    quantize(folder, out, "q8_0")
    types = {n: t for n, (t, _) in _tensors(out).items()}
    assert types["blk.0.ssm_conv1d.weight"] == "F32" and types["blk.0.ssm_a"] == "F32"
    assert types["blk.0.ssm_out.weight"] == "Q8_0"
    with sluice.load(folder, dtype="float32") as m:
        want = m.logits(SHORT)
    with sluice.load(out, dtype="float32") as m:
        assert rel_err(m.logits(SHORT), want) <= 3e-2
