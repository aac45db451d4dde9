"""FP8 folders as a CheckpointIndex: each F8_E4M3 weight one ref carrying its weight_scale_inv, and every way the
config and the tensors can disagree (one CheckpointError naming the file and the field or tensor, and what to do)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sluice import cli
from sluice.checkpoint import TensorRef
from sluice.checkpoint.fp8_index import fp8_tensors
from sluice.errors import CheckpointError
from sluice.plan import open_index

CONFIG = Path("/m/config.json")
FILE = "/m/model.safetensors"
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
_SIZE = {"F8_E4M3": 1, "F8_E5M2": 1, "F32": 4, "BF16": 2, "F16": 2, "U8": 1}


def _ref(name: str, dtype: str, shape: tuple[int, ...]) -> TensorRef:
    return TensorRef(name, FILE, 0, _SIZE[dtype] * int(torch.tensor(shape).prod()), dtype, shape)


def folder_tensors(scale: str = "F32") -> dict[str, TensorRef]:
    """A DeepSeek-V3 layer as uploaded: FP8 attention and experts with their scales, a BF16 router, norm and head."""
    t = {}
    for name, shape in (("model.layers.0.self_attn.kv_a_proj_with_mqa", (576, 7168)),  # 4.5 blocks of rows
                        ("model.layers.0.mlp.experts.0.down_proj", (7168, 2048))):
        t[f"{name}.weight"] = _ref(f"{name}.weight", "F8_E4M3", shape)
        grid = (-(-shape[0] // 128), -(-shape[1] // 128))
        t[f"{name}.weight_scale_inv"] = _ref(f"{name}.weight_scale_inv", scale, grid)
    for name, dtype, shape in (("model.layers.0.mlp.gate.weight", "BF16", (256, 7168)),
                               ("model.layers.0.mlp.gate.e_score_correction_bias", "F32", (256,)),
                               ("model.layers.0.input_layernorm.weight", "BF16", (7168,)),
                               ("lm_head.weight", "BF16", (129280, 7168))):
        t[name] = _ref(name, dtype, shape)
    return t


@pytest.mark.parametrize("scale", ["F32", "BF16", "F16"])
def test_fp8_weights_carry_their_scales(scale):
    tensors = folder_tensors(scale)
    out = fp8_tensors(tensors, {"quantization_config": FP8}, CONFIG)
    assert set(out) == set(tensors)  # the scales stay listed
    kv = out["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert kv.dtype == "fp8_e4m3" and kv.shape == (576, 7168) and kv.quantized and kv.row_nbytes == 7168
    assert kv.fp8.block == (128, 128) and kv.fp8.scale.shape == (5, 56) and kv.fp8.scale.dtype == scale
    assert out["model.layers.0.mlp.gate.weight"] == tensors["model.layers.0.mlp.gate.weight"]  # BF16 as stored
    with pytest.raises(CheckpointError, match="block format with no torch dtype"):
        kv.torch_dtype  # never read as plain float8 values without their scales


def test_a_folder_without_fp8_is_unchanged():
    tensors = {k: v for k, v in folder_tensors().items() if v.dtype != "F8_E4M3" and "scale_inv" not in k}
    assert fp8_tensors(tensors, {"quantization_config": {"quant_method": "mxfp4"}}, CONFIG) == tensors
    assert fp8_tensors(tensors, {}, CONFIG) == tensors


@pytest.mark.parametrize("changes,field,needle", [
    (dict(fmt="e5m2"), "fmt", "e4m3"),
    (dict(weight_block_size=None), "weight_block_size", "one scale per tensor"),
    (dict(weight_block_size=[128, 100]), "weight_block_size", "whole groups of 32"),
    (dict(weight_block_size=[128]), "weight_block_size", "[rows, inputs]"),
    (dict(weight_block_size="128x128"), "weight_block_size", "[rows, inputs]"),
    (dict(scale_fmt="ue8m0"), "scale_fmt", "UE8M0"),
    (dict(expert_dtype="fp4"), "expert_dtype", "FP8 experts"),
    (dict(activation_scheme="tensorwise"), "activation_scheme", "dynamic"),
    (dict(modules_to_not_convert="lm_head"), "modules_to_not_convert", "list of module names"),
    (dict(ignored_layers=[1]), "ignored_layers", "list of module names"),
])
def test_an_fp8_variant_sluice_does_not_read_names_the_field(changes, field, needle):
    with pytest.raises(CheckpointError) as e:
        fp8_tensors(folder_tensors(), {"quantization_config": {**FP8, **changes}}, CONFIG)
    assert f"quantization_config.{field}" in str(e.value) and needle in str(e.value) and str(CONFIG) in str(e.value)


def test_the_lists_of_modules_left_plain_are_read():
    """modules_to_not_convert / ignored_layers (MiniMax's spelling) may name modules: which weights are FP8 comes from
    the tensors, as in transformers' dequantizing load."""
    for key in ("modules_to_not_convert", "ignored_layers"):
        q = {**FP8, key: ["lm_head", "model.layers.0.mlp.gate"], "activation_scheme": "static"}
        assert fp8_tensors(folder_tensors(), {"quantization_config": q}, CONFIG)[
            "model.layers.0.mlp.experts.0.down_proj.weight"].fp8 is not None


def _without(name: str) -> dict[str, TensorRef]:
    return {k: v for k, v in folder_tensors().items() if k != name}


@pytest.mark.parametrize("tensors,tensor,needle", [
    (_without("model.layers.0.mlp.experts.0.down_proj.weight_scale_inv"),
     "model.layers.0.mlp.experts.0.down_proj.weight", "weight_scale_inv (its block scales) is missing"),
    (_without("model.layers.0.mlp.experts.0.down_proj.weight"),
     "model.layers.0.mlp.experts.0.down_proj.weight_scale_inv", "has no model.layers.0.mlp.experts.0.down_proj.weight"),
    ({**folder_tensors(), "model.layers.0.mlp.experts.0.down_proj.weight_scale_inv":
      _ref("model.layers.0.mlp.experts.0.down_proj.weight_scale_inv", "F32", (56, 17))},
     "model.layers.0.mlp.experts.0.down_proj.weight_scale_inv", "must be F32 / BF16 / F16 [56, 16]"),
    ({**folder_tensors(), "model.layers.0.mlp.experts.0.down_proj.weight_scale_inv":
      _ref("model.layers.0.mlp.experts.0.down_proj.weight_scale_inv", "U8", (56, 16))},
     "model.layers.0.mlp.experts.0.down_proj.weight_scale_inv", "got U8 [56, 16]"),
    ({**folder_tensors(), "model.layers.0.mlp.experts.1.up_proj.weight":
      _ref("model.layers.0.mlp.experts.1.up_proj.weight", "F8_E5M2", (2048, 7168))},
     "model.layers.0.mlp.experts.1.up_proj.weight", "F8_E5M2"),
])
def test_tensors_that_do_not_fit_name_the_tensor(tensors, tensor, needle):
    with pytest.raises(CheckpointError) as e:
        fp8_tensors(tensors, {"quantization_config": FP8}, CONFIG)
    assert e.value.tensor == tensor and needle in str(e.value) and FILE in str(e.value)


def test_scales_in_a_folder_whose_config_is_not_fp8():
    with pytest.raises(CheckpointError, match="no quantization_config with quant_method \"fp8\"") as e:
        fp8_tensors(folder_tensors(), {"torch_dtype": "bfloat16"}, CONFIG)
    assert e.value.tensor.endswith("weight_scale_inv")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    from tests.quant.fp8_files import fp8_folder

    return fp8_folder("qwen3_moe", tmp_path_factory.mktemp("fp8"))


def _broken(fp8_dir: Path, tmp: Path, edit) -> Path:
    """A copy of the FP8 folder with `edit(tensors, config)` applied to its tensors and config.json."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(fp8_dir / "model.safetensors")
    config = json.loads((fp8_dir / "config.json").read_text())
    edit(tensors, config)
    tmp.mkdir()
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config))
    return tmp


EXPERT = "model.layers.0.mlp.experts.3.up_proj.weight"


def _experts_of(width: int):
    """An edit making every expert `width` wide (gate / up [width, H], down [H, width]) in config and tensors."""
    def edit(t: dict, c: dict) -> None:
        c["moe_intermediate_size"] = width
        for name in [n for n in t if ".experts." in n and n.endswith(".weight")]:
            out, inp = t[name].shape
            shape = (out, width) if "down_proj" in name else (width, inp)
            t[name] = torch.zeros(shape, dtype=torch.float8_e4m3fn)
            t[name + "_scale_inv"] = torch.ones(-(-shape[0] // 128), -(-shape[1] // 128))
    return edit


@pytest.mark.parametrize("edit,needle", [
    (lambda t, c: t.pop(EXPERT + "_scale_inv"), f"{EXPERT}': is stored as F8_E4M3 but {EXPERT}_scale_inv"),
    (lambda t, c: t.update({EXPERT + "_scale_inv": torch.ones(3, 2)}), "must be F32 / BF16 / F16 [1, 2]"),
    (lambda t, c: c.pop("quantization_config"), "no quantization_config with quant_method"),
    (lambda t, c: c["quantization_config"].update(weight_block_size=[128, 64 + 16]), "whole groups of 32"),
    (lambda t, c: t.update({EXPERT: torch.zeros(128, 224, dtype=torch.float8_e4m3fn)}), "does not match config.json"),
    # experts 120 wide: down_proj's rows of 120 inputs are not whole groups of 32, which the kernels need (a
    # CheckpointError naming it at load, not a ValueError mid-prompt)
    (_experts_of(120), "experts stored as fp8_e4m3: FP8 weights [256, 120]"),
])
def test_a_bad_folder_is_one_error_line(fp8_dir, tmp_path, capsys, edit, needle):
    folder = _broken(fp8_dir, tmp_path / "m", edit)
    assert cli.main(["inspect", str(folder), "--usage-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and needle in err, err


def test_a_good_folder_opens(fp8_dir):
    index = open_index(fp8_dir)
    assert index[EXPERT].fp8 is not None and index["lm_head.weight"].dtype == "F32"
    assert index["model.layers.0.mlp.gate.weight"].fp8 is None  # the router stays as it was
