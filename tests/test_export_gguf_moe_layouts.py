"""`sluice export-gguf` / `sluice quantize` of gpt_oss -> gpt-oss, glm4_moe -> glm4moe and deepseek_v3 -> deepseek2:
the file reads back as the checkpoint (sluice's GGUF facts, the reader's side of tools/gguf_layouts.py), holds what
llama.cpp's own converter writes of the same checkpoint, tensor for tensor and key for key, and llama.cpp runs it to
transformers' greedy tokens. Checkpoints llama.cpp's graphs compute differently are refused in one line; files whose
router or rope sluice does not run are refused by the reader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

import sluice  # noqa: E402
from sluice.errors import ConfigError  # noqa: E402
from sluice.plan import open_index  # noqa: E402
from sluice.tools import gguf_layouts  # noqa: E402
from sluice.tools.gguf_export import ExportError, export_gguf  # noqa: E402
from sluice.tools.quantize import quantize  # noqa: E402
from tests.checkpoint import llama_cpp  # noqa: E402
from tests.checkpoint.moe_files import (GGUF_ARCH, LLAMA_RUNS, LLAMA_TINY, LONG, SHORT, hf_folder,  # noqa: E402
                                        mxfp4_folder)
from tests.models.tiny import TINY  # noqa: E402

CASES = [*LLAMA_RUNS, "gpt_oss-mxfp4"]


def _arch(case: str) -> str:
    return "gpt_oss" if case == "gpt_oss-mxfp4" else case


def _folder(case: str, root):
    return mxfp4_folder(root) if case == "gpt_oss-mxfp4" else hf_folder(case, root, **LLAMA_TINY[case])


@pytest.fixture(scope="module", params=CASES)
def exported(request, tmp_path_factory):
    """(case, transformers model, HF folder, sluice's F32 export of it)."""
    case = request.param
    root = tmp_path_factory.mktemp(case)
    folder, model = _folder(case, root)
    out = root / "sluice-f32.gguf"
    export_gguf(folder, out, "f32")
    return case, model, folder, out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out - ref).abs().max().item() / ref.abs().max().item()


def test_the_export_reads_back_as_the_checkpoint(exported):
    case, model, folder, path = exported
    assert open_index(path).arch == GGUF_ARCH[_arch(case)]
    with sluice.load(folder, dtype="float32") as m:
        want = m.logits(LONG)
    with sluice.load(path, dtype="float32") as m:  # eps and yarn's scales through float32 metadata: to its rounding
        assert rel_err(m.logits(LONG), want) <= 1e-5
    with torch.no_grad():
        assert rel_err(want, model(torch.tensor([LONG])).logits[0]) <= 1e-4


def test_mxfp4_experts_stay_mxfp4_in_every_file_type(tmp_path):
    """gpt-oss's experts are written as GGUF MXFP4 blocks (the shipped bits moved) whatever --to says, the same bytes
    in a Q8_0 file as in an F32 one; the rest follows --to."""
    folder, _ = mxfp4_folder(tmp_path)
    files = {to: tmp_path / f"m-{to}.gguf" for to in ("f32", "q8_0")}
    for to, out in files.items():
        quantize(folder, out, to)
    f32, q8 = ({t.name: t for t in gguf.GGUFReader(out).tensors} for out in files.values())
    for name in (f"blk.{L}.ffn_{p}_exps.weight" for L in range(3) for p in ("gate", "up", "down")):
        assert f32[name].tensor_type.name == q8[name].tensor_type.name == "MXFP4", name
        assert np.array_equal(np.array(f32[name].data), np.array(q8[name].data)), name
    assert q8["blk.0.attn_q.weight"].tensor_type.name == "Q8_0"
    assert q8["blk.0.ffn_gate_exps.bias"].tensor_type.name == "F32"


def _tensors(path) -> dict[str, tuple[str, np.ndarray]]:
    return {t.name: (t.tensor_type.name, np.array(t.data)) for t in gguf.GGUFReader(path).tensors}


def _arch_keys(path, arch: str) -> dict:
    f = gguf.GGUFReader(path).fields
    return {k: f[k].contents() for k in f if k.startswith(f"{arch}.")}


def _convert(case: str, folder, out, outtype: str = "f32"):
    return llama_cpp.convert(folder, out, outtype, no_mtp=case.startswith("glm4_moe"))


@pytest.mark.llama_cpp
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_the_export_holds_what_llama_cpps_converter_writes(exported, tmp_path, outtype):
    """Tensor for tensor (names, types, shapes, bytes: the same un-interleaving, transposes, kv_b split and MXFP4
    repacking) and key for key of the architecture's metadata, against convert_hf_to_gguf.py --outtype f32 / q8_0 of
    the same folder."""
    case, _, folder, path = exported
    arch = GGUF_ARCH[_arch(case)]
    if outtype != "f32":
        path = tmp_path / f"sluice-{outtype}.gguf"
        quantize(folder, path, outtype)
    theirs = _convert(case, folder, tmp_path / f"llama-{outtype}.gguf", outtype)
    ours, want = _tensors(path), _tensors(theirs)
    assert set(ours) == set(want)
    for name, (kind, values) in want.items():
        assert ours[name][0] == kind and ours[name][1].shape == values.shape, (name, ours[name][0], kind)
        assert np.array_equal(ours[name][1], values), name
    assert _arch_keys(path, arch) == _arch_keys(theirs, arch)


@pytest.mark.llama_cpp
def test_llama_cpp_runs_sluices_file_to_transformers_tokens(exported):
    case, model, _, path = exported
    ids = LONG[:100]
    got = llama_cpp.greedy(path, ids, 12)["tokens"]
    with sluice.load(path, dtype="float32") as m:
        assert list(m.generate_tokens(ids, max_tokens=12, stop_at_eos=False)) == got, case
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert got == want[0, len(ids):].tolist(), case


@pytest.mark.parametrize("case,overrides,needle", [
    ("gpt_oss", dict(LLAMA_TINY["gpt_oss"], swiglu_limit=0.5), "clamps at 7.0"),
    ("gpt_oss", dict(LLAMA_TINY["gpt_oss"], layer_types=["full_attention", "sliding_attention", "full_attention"]),
     "slides on the even layers"),
    ("deepseek_v3", dict(LLAMA_TINY["deepseek_v3"], rope_interleave=False), "rotates interleaved pairs"),
    ("deepseek_v3", dict(LLAMA_TINY["deepseek_v3"], rope_parameters=TINY["deepseek_v3"]["rope_parameters"]),
     "mscale equal to mscale_all_dim"),
    ("deepseek_v3-q_proj", LLAMA_TINY["deepseek_v3-q_proj"], "no attention biases"),
    ("glm4_moe", dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0,
                                       "partial_rotary_factor": 0.5}), "rope type 'linear'"),
])
def test_what_llama_cpps_graphs_compute_otherwise_is_refused(tmp_path, case, overrides, needle):
    folder, _ = hf_folder(case, tmp_path, **overrides)
    with pytest.raises(ExportError, match=needle):
        export_gguf(folder, tmp_path / "m.gguf", "f32")
    assert not (tmp_path / "m.gguf").exists()


def _export_with(monkeypatch, tmp_path, case: str, extra) -> object:
    """The F32 export of `case` with `extra(writer, arch)` run after its keys are written."""
    folder, _ = hf_folder(case, tmp_path, **LLAMA_TINY[case])
    keys = gguf_layouts.layout_hparams

    def patched(w, arch, spec, config):
        keys(w, arch, spec, config)
        extra(w, arch)

    monkeypatch.setattr("sluice.tools.gguf_export.layout_hparams", patched)
    out = tmp_path / "m.gguf"
    export_gguf(folder, out, "f32")
    return out


def test_a_softmax_routed_deepseek2_is_refused(tmp_path, monkeypatch):
    """A deepseek2 file without a gating function routes by softmax in llama.cpp (DeepSeek-V2): one ConfigError."""
    monkeypatch.setattr(gguf.GGUFWriter, "add_expert_gating_func", lambda self, value: None)
    out = _export_with(monkeypatch, tmp_path, "deepseek_v3", lambda w, arch: None)
    with pytest.raises(ConfigError, match="expert_gating_func is absent or not sigmoid"):
        open_index(out)


def test_glm_4_5vs_multimodal_rope_is_refused(tmp_path, monkeypatch):
    out = _export_with(monkeypatch, tmp_path, "glm4_moe", lambda w, arch: w.add_rope_dimension_sections([4, 2, 2, 0]))
    with pytest.raises(ConfigError, match="multimodal rope"):
        open_index(out)


def test_gpt_oss_sliding_pattern_keys_place_the_windows(tmp_path, monkeypatch):
    """llama.cpp's attention.sliding_window_pattern (a period, or one bool per layer) decides which layers slide."""
    out = _export_with(monkeypatch, tmp_path, "gpt_oss",
                       lambda w, arch: w.add_array(f"{arch}.attention.sliding_window_pattern", [False, True, True]))
    assert open_index(out).config["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    out = _export_with(monkeypatch, tmp_path / "b", "gpt_oss",
                       lambda w, arch: w.add_uint32(f"{arch}.attention.sliding_window_pattern", 3))
    assert open_index(out).config["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
