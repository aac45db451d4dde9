"""gpt-oss, glm4moe and deepseek2 as llama.cpp's own converter writes them: convert_hf_to_gguf.py
(tests/checkpoint/llama_cpp.py) on tiny random transformers checkpoints, then sluice on the GGUF against transformers
(F32: the converter's renames, gpt-oss's un-interleaved gate / up and repacked MXFP4 experts, deepseek2's kv_b split
into attn_k_b / attn_v_b undone) and against llama.cpp's greedy tokens on its Q8_0 files (gpt-oss: its experts MXFP4 as
the converter keeps them); streamed == resident bitwise on them.

The checkpoints: tests/checkpoint/moe_files.py (configs llama.cpp computes as transformers does; the one it cannot
load is checked against transformers only)."""

from __future__ import annotations

import pytest
import torch

import sluice
from sluice.checkpoint.gguf_index import GGUFIndex
from sluice.plan import open_index
from sluice.quant.tensor import read_tensor
from tests.checkpoint import llama_cpp
from tests.checkpoint.moe_files import (GGUF_ARCH, LLAMA_RUNS, LLAMA_TINY, LONG, Q8_SHAPES, SHORT, add_nextn_layer,
                                        hf_folder, mxfp4_folder)
from tests.quant.streaming import assert_streamed_equals_resident

pytestmark = pytest.mark.llama_cpp
FP32_REL = 1e-4  # relative to the largest logit, as tests/models/test_parity.py
NEAR_TIE = 0.01  # as tests/checkpoint/test_gguf_hybrids.py: bf16 may part from llama.cpp at a near tie, late
CASES = [*LLAMA_TINY, "gpt_oss-mxfp4"]


def _arch(case: str) -> str:
    return "gpt_oss" if case == "gpt_oss-mxfp4" else case


def _convert(case: str, folder, out, outtype: str = "f32"):
    # GLM's converter may drop the multi-token-prediction layers (--no-mtp); the others refuse the flag
    return llama_cpp.convert(folder, out, outtype, no_mtp=case.startswith("glm4_moe"))


@pytest.fixture(scope="module", params=CASES)
def f32(request, tmp_path_factory):
    """(case, transformers model, its HF folder, the F32 GGUF llama.cpp's converter writes of it: gpt_oss-mxfp4's
    experts stay MXFP4 there)."""
    case = request.param
    root = tmp_path_factory.mktemp(case)
    folder, model = mxfp4_folder(root) if case == "gpt_oss-mxfp4" else hf_folder(case, root, **LLAMA_TINY[case])
    return case, model, folder, _convert(case, folder, root / "m-f32.gguf")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out - ref).abs().max().item() / ref.abs().max().item()


def test_f32_logits_match_transformers(f32):
    case, model, _, path = f32
    index = open_index(path)
    assert isinstance(index, GGUFIndex) and index.arch == GGUF_ARCH[_arch(case)]
    if case == "gpt_oss-mxfp4":
        assert {index[f"model.layers.0.mlp.experts.{p}_proj"].dtype for p in ("gate", "up", "down")} == {"MXFP4"}
    for ids in (SHORT, LONG):
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0]
        for chunk in ("auto", 50):  # one pass; several chunks (the sliding windows and latent cache across them)
            with sluice.load(path, dtype="float32", prefill_chunk=chunk) as m:
                got = m.logits(ids)
            assert rel_err(got, want) <= FP32_REL, (case, len(ids), chunk, rel_err(got, want))


def test_deepseek2s_split_kv_b_reads_as_the_checkpoints(f32):
    """attn_k_b [nH, r, N] and attn_v_b [nH, V, r] (each head's key rows transposed, its value rows) join back into
    transformers' kv_b_proj bit for bit."""
    case, model, _, path = f32
    if not case.startswith("deepseek_v3"):
        pytest.skip("deepseek2 only")
    index = open_index(path)
    assert index.config["kv_b_split"] and "model.layers.0.self_attn.kv_b_proj.weight" not in index
    with sluice.load(path, dtype="float32") as m:
        for L, layer in enumerate(model.model.layers):
            assert torch.equal(m.model.layers[L].mixer.lw.mla.kv_b, layer.self_attn.kv_b_proj.weight), L
    assert index.gguf_names["model.layers.0.self_attn.k_b_proj.weight"] == "blk.0.attn_k_b.weight"


def test_gpt_oss_experts_are_read_as_stacks_with_their_biases(f32):
    """gate and up stacks apart (their rows un-interleaved), read back to back into one slot with their biases; the
    slot holds the stored bytes, MXFP4 blocks as the converter repacked them."""
    case, model, _, path = f32
    if not case.startswith("gpt_oss"):
        pytest.skip("gpt-oss only")
    with sluice.load(path, dtype="float32") as m:
        fmt = m.layout.format(0)
        assert fmt.halves and not fmt.transposed
        assert m.layout.format_names == (["MXFP4"] if case == "gpt_oss-mxfp4" else ["F32"])
        parts = m.layout.parts(0, 3)
        assert [p.proj for p in parts] == ["gate", "up", "gate_bias", "up_bias", "down", "down_bias"]
        assert parts[1].dest_offset == parts[0].range.nbytes  # up's rows right after gate's: one [2I, H] weight
    index = open_index(path)
    ex = model.model.layers[1].mlp.experts
    gate = read_tensor(index["model.layers.1.mlp.experts.gate_proj"])  # [E, I, H]
    assert torch.equal(gate, ex.gate_up_proj[:, :, 0::2].transpose(1, 2))
    assert torch.equal(read_tensor(index["model.layers.1.mlp.experts.up_proj_bias"]), ex.gate_up_proj_bias[:, 1::2])


IO_MODES = [("mmap", False), ("willneed", False), ("direct", False), ("direct", True)]


@pytest.mark.parametrize("io,odirect", IO_MODES)
def test_streamed_equals_resident_bitwise(f32, io, odirect):
    _, _, _, path = f32
    assert_streamed_equals_resident(path, LONG[:80], io, odirect, "min")


def test_llama_cpp_agrees_with_transformers_on_the_f32_file(f32):
    """The reference check first: llama.cpp's greedy tokens on the F32 file are transformers'; then sluice's."""
    case, model, _, path = f32
    if _arch(case) not in LLAMA_RUNS:
        pytest.skip(f"llama.cpp does not load {case} (tests/checkpoint/moe_files.py)")
    ids = LONG[:100]
    ref = llama_cpp.greedy(path, ids, 12)
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert ref["tokens"] == want[0, len(ids):].tolist(), case
    with sluice.load(path, dtype="float32") as m:
        assert list(m.generate_tokens(ids, max_tokens=12, stop_at_eos=False)) == ref["tokens"]


@pytest.fixture(scope="module", params=[*Q8_SHAPES, "gpt_oss-mxfp4"])
def q8_0(request, tmp_path_factory):
    """(case, the converter's --outtype q8_0 file of a checkpoint whose rows are whole Q8_0 blocks; gpt_oss-mxfp4:
    its experts MXFP4, the rest Q8_0)."""
    case = request.param
    root = tmp_path_factory.mktemp(f"{case}-q8_0")
    folder, _ = mxfp4_folder(root) if case == "gpt_oss-mxfp4" else hf_folder(case, root, **Q8_SHAPES[case])
    return case, _convert(case, folder, root / "m-q8_0.gguf", "q8_0")


def _parts_at_a_near_tie(m, ids: list[int], ref: list[int], got: list[int], tie: float, first: int) -> None:
    """sluice's greedy tokens `got` equal llama.cpp's `ref`, or part from them no earlier than token `first` where
    llama.cpp's token is within `tie` x the logits' range of sluice's best (a near tie: llama.cpp codes activations
    in 8 bits for its Q8_0 dot products, ~1% of the logits)."""
    at = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
    if at is not None:
        logits = m.logits(ids + ref[:at])[-1]
        gap = float(logits[got[at]] - logits[ref[at]])
        assert at >= first and gap <= tie * float(logits.max() - logits.min()), (at, gap)


def test_q8_0_files_give_llama_cpps_greedy_tokens(q8_0):
    """The file's exact dequantization in float32 gives llama.cpp's prompt logits within its activation coding's
    error and its greedy tokens up to a near tie (glm4_moe_qknorm parts at token 11 by 0.2% of the logits' range;
    REFERENCES.md's qwen3_moe agreed 16/16); bf16 and the integer kernels likewise."""
    case, path = q8_0
    index = open_index(path)
    experts = {index[f"model.layers.1.mlp.experts.{p}_proj"].dtype for p in ("gate", "up", "down")}
    assert experts == ({"MXFP4"} if case == "gpt_oss-mxfp4" else {"Q8_0"}), experts
    ids = LONG[:100]
    llama = llama_cpp.greedy(path, ids, 16)
    ref, want = llama["tokens"], torch.tensor(llama["logits"])
    with sluice.load(path, dtype="float32") as m:
        # llama.cpp's Q8_0 dot products code activations in 8 bits: relative L2 5.6e-2 on a tiny qwen3_moe
        # (REFERENCES.md), 5.2e-2 on gpt_oss here
        assert ((m.logits(ids) - want).norm() / want.norm()).item() <= 8e-2, case
        got = list(m.generate_tokens(ids, max_tokens=16, stop_at_eos=False))
        _parts_at_a_near_tie(m, ids, ref, got, NEAR_TIE / 2, 4)
    with sluice.load(path) as m:
        got = list(m.generate_tokens(ids, max_tokens=16, stop_at_eos=False))
        _parts_at_a_near_tie(m, ids, ref, got, NEAR_TIE, 4)


@pytest.mark.parametrize("io,odirect", IO_MODES)
def test_q8_0_streamed_equals_resident_bitwise(q8_0, io, odirect):
    """In the default dtype: the Q8_0 (and MXFP4) blocks kept and run by the kernels, streamed alike."""
    _, path = q8_0
    assert_streamed_equals_resident(path, LONG[:80], io, odirect, "min")


def test_glm4moes_nextn_layer_loads_and_is_never_read(tmp_path):
    """Converted with GLM's multi-token-prediction layer (nextn_predict_layers 1: blk.3 with its nextn.* tensors),
    the file opens as the same model, the layer listed under its GGUF names and never read."""
    folder, _ = hf_folder("glm4_moe", tmp_path)
    plain = _convert("glm4_moe", folder, tmp_path / "plain.gguf")
    add_nextn_layer(folder)
    with_mtp = llama_cpp.convert(folder, tmp_path / "mtp.gguf", no_mtp=False)
    index = open_index(with_mtp)
    assert index.config["num_hidden_layers"] == 3 and index.metadata["glm4moe.nextn_predict_layers"] == 1
    head = [n for n in index.tensors if n.startswith("blk.3.")]
    assert "blk.3.nextn.eh_proj.weight" in head and all(index[n].name == n for n in head)
    with sluice.load(plain, dtype="float32") as m:
        want = m.logits(SHORT)
    with sluice.load(with_mtp, dtype="float32") as m:
        assert torch.equal(m.logits(SHORT), want)


@pytest.mark.parametrize("arch", ["gpt_oss", "glm4_moe", "deepseek_v3"])
def test_make_models_checkpoints_convert_and_read_back(tmp_path, arch):
    """`sluice make-model` writes what llama.cpp's converter takes (GLM's special tokens, the hub's DeepSeek
    scoring_func, gpt-oss's MXFP4 experts); sluice reads the file as llama.cpp computes it (prompt logits within
    its float32 error) and, where llama.cpp's rope is the checkpoint's, as the checkpoint itself (gpt-oss's
    make-model rope says truncate false, as gpt-oss-20b's does; llama.cpp truncates)."""
    from sluice.tools.synth import SynthConfig, make_model

    sc = SynthConfig(arch=arch, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=4 if arch == "deepseek_v3"
                     else 2, head_dim=16, num_experts=8, top_k=2, moe_intermediate_size=32, vocab_size=300,
                     dtype="float32")
    folder = make_model(tmp_path / "m", sc, progress=False)
    path = _convert(arch, folder, tmp_path / "m.gguf")
    ref = torch.tensor(llama_cpp.greedy(path, SHORT, 1)["logits"])
    with sluice.load(path, dtype="float32") as m:
        got = m.logits(SHORT)
    assert ((got - ref).norm() / ref.norm()).item() <= 1e-3, arch
    if arch != "gpt_oss":
        with sluice.load(folder, dtype="float32") as m:
            assert rel_err(got, m.logits(SHORT)) <= FP32_REL, arch
