"""`sluice quantize --to fp8`: the layout of the hub's FP8 uploads (F8_E4M3 weights beside F32 weight_scale_inv of
128 x 128 blocks, routers / norms / embeddings / lm_head as they were, config quantization_config), which transformers
loads and sluice runs from the command line."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

import sluice
from sluice import cli
from sluice.quant.fp8 import dequantize_fp8
from sluice.tools.fp8_export import planned_bytes
from sluice.tools.synth import SynthConfig, make_model
from tests.quant.fp8_files import transformers_fp8

# DeepSeek-V3's proportions at hidden 256: q_lora 192, kv_lora 64, experts of 128 (a shared one), a dense first layer
DEEPSEEK = SynthConfig(arch="deepseek_v3", hidden_size=256, num_layers=3, num_heads=4, num_kv_heads=4, head_dim=16,
                       num_experts=8, top_k=2, moe_intermediate_size=128, vocab_size=320, dtype="float32")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(source folder from make-model, its FP8 export through the command line, the summary printed)."""
    tmp = tmp_path_factory.mktemp("q")
    src = make_model(tmp / "src", DEEPSEEK, progress=False)
    assert cli.main(["quantize", str(src), str(tmp / "fp8"), "--to", "fp8", "--json", "--no-progress"]) == 0
    return src, tmp / "fp8"


def test_the_hub_layout(exported):
    src, out = exported
    source, ours = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    fp8 = {n for n, t in ours.items() if t.dtype == torch.float8_e4m3fn}
    assert {n + "_scale_inv" for n in fp8} == {n for n in ours if n.endswith("_scale_inv")}
    assert set(ours) == set(source) | {n + "_scale_inv" for n in fp8}
    kinds = {re.sub(r"\.\d+\.", ".", n) for n in fp8}  # layer and expert numbers dropped
    assert kinds == {f"model.layers.{k}.weight" for k in (
        "self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.shared_experts.gate_proj",
        "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj", "mlp.experts.gate_proj", "mlp.experts.up_proj",
        "mlp.experts.down_proj")}
    for name, t in ours.items():
        if name in fp8:
            s = ours[name + "_scale_inv"]
            assert s.dtype == torch.float32 and s.shape == (-(-t.shape[0] // 128), -(-t.shape[1] // 128))
            w = source[name].float()
            assert ((dequantize_fp8(t, s, (128, 128)) - w).abs() <= w.abs() / 16 + s.max() * 2.0 ** -9).all()
        elif not name.endswith("_scale_inv"):  # routers, norms, embeddings, lm_head: as they were
            assert torch.equal(t, source[name]), name
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                 "modules_to_not_convert": ["lm_head", "model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]}
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    assert planned_bytes(src) == sum(t.numel() * t.element_size() for t in ours.values())  # the progress bar's total


def test_transformers_loads_it_and_sluice_runs_it(exported, capsys):
    """transformers' FP8 dequantization of the folder (tests/quant/fp8_files.py) and sluice give the same greedy
    tokens; `sluice run` runs the folder with its tokenizer."""
    _, out = exported
    model = transformers_fp8(out, out.parent)
    with torch.no_grad():
        want = model.generate(torch.tensor([[5, 9, 13]]), max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert cli.main(["run", str(out), "--prompt", "hello", "--max-tokens", "6", "--json", "--dtype", "float32"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) >= 1
    with sluice.load(out, memory="all", dtype="float32") as m:
        assert list(m.generate_tokens([5, 9, 13], max_tokens=6, stop_at_eos=False)) == want[0, 3:].tolist()


@pytest.mark.parametrize("what,needle", [("fp8", "quantized already"), ("fused", "per expert")])
def test_sources_it_cannot_export(exported, tmp_path, capsys, what, needle):
    src, out = exported
    if what == "fused":
        sc = SynthConfig(**{**DEEPSEEK.__dict__, "layout": "fused", "hidden_size": 64, "moe_intermediate_size": 32})
        src = make_model(tmp_path / "fused", sc, progress=False)
    else:
        src = out
    assert cli.main(["quantize", str(src), str(tmp_path / "x"), "--to", "fp8", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and not (tmp_path / "x").exists()


def test_an_fp8_folder_exports_to_gguf(exported, tmp_path):
    """`sluice quantize FP8 out.gguf --to f32` writes the dequantized weights (the FP8 experts stacked in float32):
    the same model."""
    _, out = exported
    assert cli.main(["quantize", str(out), str(tmp_path / "m.gguf"), "--to", "f32", "--no-progress"]) == 0
    ids = [5, 9, 13, 100, 7]
    with sluice.load(out, memory="all", dtype="float32") as m:
        want = m.logits(ids)
    with sluice.load(tmp_path / "m.gguf", memory="all", dtype="float32") as m:
        assert ((m.logits(ids) - want).norm() / want.norm()).item() < 1e-6


def test_an_fp8_folder_exports_to_mlx(exported, tmp_path):
    """`sluice quantize FP8 OUT --to mlx-4bit` quantizes the dequantized weights, its scales left out: tensor for
    tensor the MLX folder of transformers' dequantization of it."""
    pytest.importorskip("mlx.core", reason="MLX output needs mlx (pip install 'mlx[cpu]')")
    from sluice.tools.quantize import quantize

    _, out = exported
    transformers_fp8(out, tmp_path)  # writes tmp_path / "dequantized": float32, the same names, no scales
    quantize(out, tmp_path / "a", "mlx-4bit")
    quantize(tmp_path / "dequantized", tmp_path / "b", "mlx-4bit")
    a, b = load_file(tmp_path / "a/model.safetensors"), load_file(tmp_path / "b/model.safetensors")
    assert sorted(a) == sorted(b) and not any(n.endswith("_scale_inv") for n in a)
    for name in a:
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
