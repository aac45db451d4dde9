"""`sluice quantize --to tq1_0 | tq2_0 | mxfp4`: the low-bit types the `gguf` package can encode. The file's blocks are
exactly `gguf.quants.quantize` of the checkpoint's weights, in the places llama.cpp's tools put them (the converter's
`--outtype tq1_0 / tq2_0`: embeddings and output F16; llama-quantize's MXFP4_MOE: routed experts MXFP4, the rest
Q8_0); sluice's float32 logits are those of the file's own dequantization; llama.cpp runs the file to sluice's greedy
tokens (the demo model: its trained weights give clear margins, which a random tiny model's ternary logits do not)."""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

import sluice  # noqa: E402
from sluice.tools.inflate import demo_model_dir  # noqa: E402
from sluice.tools.quantize import quantize  # noqa: E402
from sluice.tools.synth import make_model  # noqa: E402
from tests.checkpoint import llama_cpp  # noqa: E402
from tests.quant.test_gguf_lowbit_models import gguf_read  # noqa: E402
from tests.quant.test_gguf_models import _rel_l2, dequantized_reference  # noqa: E402
from tests.test_quantize import IDS, LOWBIT, Q, _expected_f32, _file_tensors, tiny_config  # noqa: E402

BLOCK = {"TQ1_0": 256, "TQ2_0": 256, "MXFP4": 32, "Q8_0": 32}


def _expected_type(name: str, shape: tuple[int, ...], to: str) -> str:
    """The type rule of these three, written out from llama.cpp's tools independently of tools/gguf_types.py."""
    if len(shape) == 1 or name.endswith(("norm.weight", "ffn_gate_inp.weight", ".bias")):
        return "F32"
    if to == "mxfp4":
        want = "MXFP4" if "_exps." in name else "Q8_0"
    elif name in ("token_embd.weight", "output.weight"):
        return "F16"  # convert_hf_to_gguf.py --outtype tq1_0 / tq2_0
    else:
        want = to.upper()
    return want if shape[-1] % BLOCK[want] == 0 else "F16"


def _check_file(src, out, to: str) -> dict[str, str]:
    """Every tensor of `out` in its expected type and exactly gguf's encoding of the checkpoint; name -> type."""
    got, want = _file_tensors(out), _expected_f32(src)
    assert set(got) == set(want)
    for name, (kind, shape, raw) in got.items():
        assert shape == want[name].shape, name
        assert kind == _expected_type(name, shape, to), (name, kind)
        assert raw == gguf.quants.quantize(want[name], Q[kind]).tobytes(), name
    return {name: kind for name, (kind, _, _) in got.items()}


def _file_reference(src, out):
    """transformers' model of `src` with every weight replaced by the GGUF `out`'s dequantization (gguf's)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager")
    return dequantized_reference(model, out, read=gguf_read)


@pytest.fixture(scope="module")
def whole_blocks(tmp_path_factory):
    """A tiny qwen3_moe whose every 2-D row is whole 256-blocks (hidden, expert intermediate and heads 256)."""
    cfg = tiny_config("qwen3_moe", hidden_size=256, head_dim=64, moe_intermediate_size=256)
    return make_model(tmp_path_factory.mktemp("lowbit") / "m", cfg, progress=False)


@pytest.mark.parametrize("to", LOWBIT)
def test_reference_encoding_and_the_files_own_logits(whole_blocks, tmp_path, to):
    out = tmp_path / "m.gguf"
    summary = quantize(whole_blocks, out, to)
    assert summary["type"] == to and summary["fallbacks"] == [] and summary["bytes"] == out.stat().st_size
    types = _check_file(whole_blocks, out, to)
    assert types["blk.0.ffn_down_exps.weight"] == to.upper()
    assert gguf.GGUFReader(out).fields["general.file_type"].contents() == {
        "tq1_0": gguf.LlamaFileType.MOSTLY_TQ1_0, "tq2_0": gguf.LlamaFileType.MOSTLY_TQ2_0,
        "mxfp4": gguf.LlamaFileType.MOSTLY_MXFP4_MOE}[to]
    with torch.no_grad():
        want = _file_reference(whole_blocks, out)(torch.tensor([IDS])).logits[0]
    with sluice.load(out, memory="all", dtype="float32") as m:
        assert m.layout.format_names == [to.upper()]  # the experts stay in their blocks
        got = m.logits(IDS)
    # float32 rounding only (the lowbit model tests measure 4e-7 to 1.2e-6 on such files)
    assert _rel_l2(got, want) <= 1e-5, (to, _rel_l2(got, want))


def test_rows_that_are_not_whole_ternary_blocks_fall_back_to_f16(tmp_path):
    """The demo's shape: expert intermediate 64, so ffn_down rows are not whole 256-blocks: F16, named (as
    convert_hf_to_gguf.py falls back); MXFP4's 32-blocks take them."""
    src = make_model(tmp_path / "m64", tiny_config("qwen3_moe", hidden_size=256, head_dim=64,
                                                   moe_intermediate_size=64), progress=False)
    summary = quantize(src, tmp_path / "t.gguf", "tq2_0")
    downs = [f"blk.{n}.ffn_down_exps.weight" for n in range(2)]
    assert summary["fallbacks"] == [f"{d}: rows of 64 values are not whole TQ2_0 blocks of 256, F16" for d in downs]
    assert _check_file(src, tmp_path / "t.gguf", "tq2_0")[downs[0]] == "F16"
    assert quantize(src, tmp_path / "x.gguf", "mxfp4")["fallbacks"] == []
    with sluice.load(tmp_path / "t.gguf", memory="all") as m:
        assert m.layout.format_names == ["F16", "TQ2_0"]


@pytest.mark.llama_cpp
@pytest.mark.parametrize("to", LOWBIT)
def test_llama_cpp_runs_the_file_to_sluices_tokens(tmp_path, to):
    """The demo model in each type: llama.cpp's greedy tokens are sluice's, float32 and bf16 (default) alike."""
    llama_cpp.need_peers()
    out = tmp_path / f"demo-{to}.gguf"
    quantize(demo_model_dir(), out, to)
    with sluice.load(out, memory="all") as m:
        prompt = m.tokenizer.encode("The following example shows how to", add_special_tokens=True)
    ref = llama_cpp.greedy(out, prompt, 16)["tokens"]
    for dtype in ("float32", "auto"):
        with sluice.load(out, memory="all", dtype=dtype) as m:
            got = list(m.generate_tokens(prompt, max_tokens=16, temperature=0.0, stop_at_eos=False))
        assert got == ref, (to, dtype)
