"""`sluice quantize SRC OUT --to TYPE`: GGUF files laid out as llama.cpp's converter + quantizer lay them out, whose
blocks are exactly `gguf.quants.quantize` of the checkpoint's weights, that sluice loads (and computes from) for every
supported architecture; bad input is one clean error line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

import sluice  # noqa: E402
from sluice import cli  # noqa: E402
from sluice.errors import ConfigError  # noqa: E402
from sluice.quant.tensor import read_tensor  # noqa: E402
from sluice.tools.gguf_export import ExportError  # noqa: E402
from sluice.tools.gguf_types import GGUF_TYPES  # noqa: E402
from sluice.tools.quantize import quantize  # noqa: E402
from sluice.tools.synth import OutputExistsError, SynthConfig, make_model  # noqa: E402
from tests.checkpoint.gguf_files import permute  # noqa: E402
from tests.test_disk_full import full_disk, sluice_cli  # noqa: E402,F401 (a fixture)
from sluice.plan import open_index

Q = gguf.GGMLQuantizationType
IDS = list(range(3, 40))
LOWBIT = ("tq1_0", "tq2_0", "mxfp4")  # their own mixes and 256-blocks: tests/test_quantize_lowbit.py


def tiny_config(arch: str, **kw) -> SynthConfig:
    base = dict(arch=arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                num_experts=8 if arch == "mixtral" else 4, top_k=2, moe_intermediate_size=32, vocab_size=300)
    return SynthConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> a tiny bf16 folder written by make-model (a trained-style tokenizer included)."""
    root = tmp_path_factory.mktemp("q")
    return {arch: make_model(root / arch, tiny_config(arch), progress=False)
            for arch in ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral")}


def _file_tensors(path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (GGML type name, torch-order shape, raw bytes) of every tensor, as gguf's own reader sees them."""
    return {t.name: (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)), np.asarray(t.data).tobytes())
            for t in gguf.GGUFReader(path).tensors}


def _expected_f32(folder) -> dict[str, np.ndarray]:
    """llama.cpp name -> the checkpoint's values as float32, built independently of sluice's export plan: experts
    stacked, Mixtral's q/k permuted as convert_hf_to_gguf.py permutes them, qwen2moe's shared gate squeezed."""
    idx = open_index(folder)
    cfg = idx.config
    mixtral = cfg["model_type"] == "mixtral"
    get = lambda n: read_tensor(idx[n]).float().numpy()  # noqa: E731
    want = {"token_embd.weight": get("model.embed_tokens.weight"), "output_norm.weight": get("model.norm.weight")}
    if "lm_head.weight" in idx:
        want["output.weight"] = get("lm_head.weight")
    E = cfg.get("num_experts") or cfg["num_local_experts"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for n in range(cfg["num_hidden_layers"]):
        p, g = f"model.layers.{n}", f"blk.{n}"
        moe = f"{p}.block_sparse_moe" if mixtral else f"{p}.mlp"
        want[f"{g}.attn_norm.weight"] = get(f"{p}.input_layernorm.weight")
        want[f"{g}.ffn_norm.weight"] = get(f"{p}.post_attention_layernorm.weight")
        want[f"{g}.ffn_gate_inp.weight"] = get(f"{moe}.gate.weight")
        for hf, gg in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
            w = get(f"{p}.self_attn.{hf}_proj.weight")
            want[f"{g}.{gg}.weight"] = permute(w, heads, None if hf == "q" else kv) if mixtral and hf in "qk" else w
            if f"{p}.self_attn.{hf}_proj.bias" in idx:
                want[f"{g}.{gg}.bias"] = get(f"{p}.self_attn.{hf}_proj.bias")
        for hf in ("q_norm", "k_norm"):
            if f"{p}.self_attn.{hf}.weight" in idx:
                want[f"{g}.attn_{hf}.weight"] = get(f"{p}.self_attn.{hf}.weight")
        projs = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        for hf, gg in zip(projs, ("gate", "up", "down")):
            want[f"{g}.ffn_{gg}_exps.weight"] = np.stack([get(f"{moe}.experts.{e}.{hf}.weight") for e in range(E)])
        if f"{p}.mlp.shared_expert_gate.weight" in idx:
            want[f"{g}.ffn_gate_inp_shexp.weight"] = get(f"{p}.mlp.shared_expert_gate.weight").reshape(-1)
            for proj in ("gate", "up", "down"):
                want[f"{g}.ffn_{proj}_shexp.weight"] = get(f"{p}.mlp.shared_expert.{proj}_proj.weight")
    return want


def _expected_type(name: str, shape: tuple[int, ...], to: str, n_experts: int) -> str:
    """The type rule, written out from llama.cpp's tools independently of sluice/tools/gguf_types.py."""
    if len(shape) == 1 or name.endswith(("norm.weight", "ffn_gate_inp.weight", ".bias")):
        return "F32"
    want = to.upper()
    if to in ("q4_0", "q4_1", "q5_0", "q5_1") and (
            name == "output.weight" or (n_experts == 8 and name.endswith(("attn_k.weight", "attn_v.weight")))):
        want = "Q8_0"
    return want if want in ("F32", "F16", "BF16") or shape[-1] % 32 == 0 else "F16"


def _check_file(src, out, to: str) -> None:
    got, want = _file_tensors(out), _expected_f32(src)
    assert set(got) == set(want)
    E = open_index(src).config.get("num_experts") or 8
    for name, (kind, shape, raw) in got.items():
        values = want[name]
        assert shape == values.shape, name
        assert kind == _expected_type(name, shape, to, E), name
        assert raw == gguf.quants.quantize(values, Q[kind]).tobytes(), name  # the reference encoder's bytes


@pytest.mark.parametrize("to", [t for t in GGUF_TYPES if t not in LOWBIT])
def test_every_type_is_the_reference_encoding_and_loads(models, tmp_path, to):
    src, out = models["qwen3_moe"], tmp_path / "m.gguf"
    summary = quantize(src, out, to)
    assert out.is_file() and not (tmp_path / "m.gguf.partial").exists()
    assert summary["type"] == to and summary["bytes"] == out.stat().st_size and summary["fallbacks"] == []
    _check_file(src, out, to)
    with sluice.load(src, memory="all", dtype="float32") as m:
        want = m.logits(IDS)
    with sluice.load(out, memory="all", dtype="float32") as m:
        got = m.logits(IDS)
    err = ((got - want).norm() / want.norm()).item()
    # f32 / bf16 hold the bf16 checkpoint's exact values; 8 and 4-5 bit blocks cost about 1% and 10% here
    assert err <= {"f32": 0, "bf16": 0, "f16": 1e-3, "q8_0": 2e-2}.get(to, 0.15), (to, err)


@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe", "mixtral"])
def test_every_architecture_runs_exactly_in_f32_and_quantizes(models, tmp_path, arch):
    """f32 is the checkpoint's own math (names, Mixtral's q/k permutation, biases, shared experts all right);
    q4_0 is the reference encoding with llama.cpp's mix (Mixtral's 8 experts: attn_k/attn_v in Q8_0)."""
    src = models[arch]
    with sluice.load(src, memory="all", dtype="float32") as m:
        want = m.logits(IDS)
    quantize(src, tmp_path / "f32.gguf", "f32")
    with sluice.load(tmp_path / "f32.gguf", memory="all", dtype="float32") as m:
        assert torch.equal(m.logits(IDS), want)
    quantize(src, tmp_path / "q4.gguf", "q4_0")
    _check_file(src, tmp_path / "q4.gguf", "q4_0")
    with sluice.load(tmp_path / "q4.gguf", memory="all", dtype="float32") as m:
        assert m.layout.format_names == ["Q4_0"]  # the experts stay in their blocks
        assert ((m.logits(IDS) - want).norm() / want.norm()).item() < 0.15


def test_rows_that_are_not_whole_blocks_fall_back_to_f16(tmp_path, capsys):
    """An expert intermediate of 48: ffn_down rows are 48 values, not whole 32-blocks -> F16, named on stderr."""
    src = make_model(tmp_path / "m48", tiny_config("qwen3_moe", moe_intermediate_size=48), progress=False)
    out = tmp_path / "m.gguf"
    assert cli.main(["quantize", str(src), str(out), "--to", "q4_0", "--json", "--no-progress"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    downs = [f"blk.{n}.ffn_down_exps.weight" for n in range(2)]
    assert [f.split(":")[0] for f in summary["fallbacks"]] == downs
    assert all(f"note: {d}: rows of 48 values are not whole Q4_0 blocks of 32, F16" in captured.err for d in downs)
    _check_file(src, out, "q4_0")
    with sluice.load(out, memory="all") as m:
        assert m.layout.format_names == ["F16", "Q4_0"]


def test_streamed_equals_resident_on_a_quantized_output(models, tmp_path):
    out = tmp_path / "m.gguf"
    quantize(models["qwen3_moe"], out, "q4_0")
    with sluice.load(out, memory="all") as m:
        want, resident, layout = m.logits(IDS), m.resident_bytes, m.layout
    with sluice.load(out, memory=resident + 2 * layout.expert_nbytes, io="direct") as m:
        assert torch.equal(m.logits(IDS), want)


def test_transformers_loads_the_gguf(models, tmp_path):
    """transformers' own GGUF loader (it dequantizes with the gguf package) reads the file as the same model."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    out = tmp_path / "m.gguf"
    quantize(models["qwen3_moe"], out, "q8_0")
    cfg = load_gguf_checkpoint(str(out), return_tensors=False)["config"]
    # transformers 5.x maps no key to moe_intermediate_size (it reads feed_forward_length only): give it the file's
    cfg["moe_intermediate_size"] = int(gguf.GGUFReader(out).fields["qwen3moe.expert_feed_forward_length"].contents())
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    sd = load_gguf_checkpoint(str(out), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    with torch.no_grad():
        want = model(torch.tensor([IDS])).logits[0]
    with sluice.load(out, memory="all", dtype="float32") as m:
        got = m.logits(IDS)
    assert ((got - want).norm() / want.norm()).item() <= 1e-3


# -- bad input: one clean error line ---------------------------------------------------------------------------------
def _error_lines(capsys, argv) -> list[str]:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.err.splitlines()


def test_unknown_type(models, tmp_path, capsys):
    (line,) = _error_lines(capsys, ["quantize", str(models["olmoe"]), str(tmp_path / "x.gguf"), "--to", "q3_k"])
    assert line.startswith("sluice quantize: error: --to 'q3_k' is not a known type; choose one of f32, f16, bf16")
    assert "llama-quantize" in line and not (tmp_path / "x.gguf").exists()


def test_existing_output_is_kept_unless_forced(models, tmp_path, capsys):
    out = tmp_path / "x.gguf"
    out.write_bytes(b"mine")
    (line,) = _error_lines(capsys, ["quantize", str(models["olmoe"]), str(out), "--to", "q8_0", "--no-progress"])
    assert line == f"sluice quantize: error: {out} exists; pass --force to replace it"
    assert out.read_bytes() == b"mine"
    with pytest.raises(OutputExistsError, match="is a directory"):
        quantize(models["olmoe"], tmp_path, "q8_0")
    assert cli.main(["quantize", str(models["olmoe"]), str(out), "--to", "q8_0", "--no-progress", "--force"]) == 0
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == "olmoe"


def test_special_outputs_are_never_replaced(models, tmp_path, capsys):
    from tests.test_export_gguf import _kinds, special_outputs

    cases = special_outputs(tmp_path)  # a symbolic link loop was replaced by the output
    before = _kinds([p for p, _ in cases])
    for path, kind in cases:
        for to in ("q8_0", "mlx-4bit"):
            (line,) = _error_lines(capsys, ["quantize", str(models["olmoe"]), str(path), "--to", to,
                                            "--no-progress", "--force"])
            assert f"{path} " in line and kind in line and "choose another OUT" in line, line
    assert _kinds([p for p, _ in cases]) == before


def test_unsupported_architecture_or_math(models, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in models["olmoe"].iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    cfg = json.loads((models["olmoe"] / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    (line,) = _error_lines(capsys, ["quantize", str(bad), str(tmp_path / "x.gguf"), "--to", "q4_0"])
    assert line == (f"sluice quantize: error: {bad / 'config.json'}: model_type \"llama\" is not supported; GGUF "
                    "export supports deepseek_v3, glm4_moe, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_5_moe, "
                    "qwen3_5_moe_text, qwen3_moe, qwen3_next")
    (bad / "config.json").write_text(json.dumps({**cfg, "clip_qkv": 8.0}))
    with pytest.raises(ExportError, match="clip_qkv"):
        quantize(bad, tmp_path / "x.gguf", "q4_0")
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": "2"}))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        quantize(bad, tmp_path / "x.gguf", "q4_0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_full_disk(models, full_disk):
    out = full_disk / "m.gguf"
    r = sluice_cli("quantize", str(models["qwen3_moe"]), str(out), "--to", "q8_0", "--no-progress")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"sluice quantize: error: cannot write {out}: ")
    assert "the disk is full" in line and line.endswith(f"; the partial output {out}.partial was removed")
    assert list(full_disk.iterdir()) == []
