"""MLX folders as a CheckpointIndex: mlx-lm's names -> sluice's, quantized modules as one ref, and every way the
config and the tensors can disagree (a CheckpointError naming the file and tensor)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import sluice
from sluice.checkpoint import CheckpointIndex, TensorRef
from sluice.checkpoint.mlx_index import mlx_tensors
from sluice.errors import CheckpointError
from sluice.plan import open_index

CONFIG = Path("/m/config.json")
FILE = "/m/model.safetensors"


def _ref(name: str, dtype: str, shape: tuple[int, ...]) -> TensorRef:
    size = {"U32": 4, "F32": 4, "BF16": 2, "F16": 2, "U8": 1}[dtype]
    return TensorRef(name, FILE, 0, size * int(torch.tensor(shape).prod()), dtype, shape)


def _quantized(module: str, out: tuple[int, ...], n_in: int, bits: int = 4, group: int = 64, dtype: str = "BF16"):
    return {f"{module}.weight": _ref(f"{module}.weight", "U32", (*out, n_in * bits // 32)),
            f"{module}.scales": _ref(f"{module}.scales", dtype, (*out, n_in // group)),
            f"{module}.biases": _ref(f"{module}.biases", dtype, (*out, n_in // group))}


def folder_tensors() -> dict[str, TensorRef]:
    """A layer as mlx-lm writes it: 4-bit attention and experts, an 8-bit router, a plain dense down_proj, a bias."""
    t = {}
    t.update(_quantized("model.layers.0.self_attn.q_proj", (96,), 64))
    t["model.layers.0.self_attn.q_proj.bias"] = _ref("model.layers.0.self_attn.q_proj.bias", "BF16", (96,))
    t.update(_quantized("model.layers.0.mlp.gate", (8,), 64, bits=8))
    for proj, out, n_in in (("gate_proj", 128, 64), ("up_proj", 128, 64), ("down_proj", 64, 128)):
        t.update(_quantized(f"model.layers.0.mlp.switch_mlp.{proj}", (8, out), n_in))
    t["model.layers.1.mlp.down_proj.weight"] = _ref("model.layers.1.mlp.down_proj.weight", "BF16", (64, 48))
    return t


def config(**quant) -> dict:
    q = {"group_size": 64, "bits": 4, "mode": "affine", "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}}
    return {"model_type": "qwen3_moe", "quantization": {**q, **quant}}


def test_names_and_quantized_refs():
    got = mlx_tensors(folder_tensors(), config(), CONFIG)
    gate = got["model.layers.0.mlp.experts.gate_proj"]  # stacked experts under the names store/layout.py reads
    assert gate.shape == (8, 128, 64) and gate.dtype == "mlx4" and gate.quantized
    assert gate.name == "model.layers.0.mlp.switch_mlp.gate_proj.weight"  # errors name the tensor as stored
    assert (gate.mlx.bits, gate.mlx.group_size) == (4, 64)
    assert gate.mlx.scales.name == "model.layers.0.mlp.switch_mlp.gate_proj.scales"
    assert got["model.layers.0.mlp.experts.down_proj"].shape == (8, 64, 128)
    router = got["model.layers.0.mlp.gate.weight"]
    assert router.shape == (8, 64) and router.mlx.bits == 8  # the per-module override
    assert got["model.layers.0.self_attn.q_proj.weight"].shape == (96, 64)
    assert got["model.layers.0.self_attn.q_proj.bias"].mlx is None  # a Linear's own bias is a plain tensor
    assert got["model.layers.1.mlp.down_proj.weight"].mlx is None  # left unquantized by the converter
    assert "model.layers.0.mlp.experts.gate_proj.scales" in got  # counted in the checkpoint's bytes and files


@pytest.mark.parametrize("quant,field", [
    (dict(bits=7), "quantization.bits"),
    (dict(bits=1), "quantization.bits"),
    (dict(group_size=16), "quantization.group_size"),
    (dict(mode="mxfp4"), "quantization.mode"),
    ({"model.layers.0.mlp.gate": {"group_size": 64, "bits": 3.5}}, "quantization.model.layers.0.mlp.gate.bits"),
    ({"model.layers.0.mlp.gate": 8}, "'model.layers.0.mlp.gate'"),
])
def test_unsupported_quantization_names_the_config_field(quant, field):
    with pytest.raises(CheckpointError, match="sluice reads|MLX affine groups|must be an object") as e:
        mlx_tensors(folder_tensors(), config(**quant), CONFIG)
    assert e.value.file == str(CONFIG) and field in str(e.value)


@pytest.mark.parametrize("drop", ["scales", "biases"])
def test_a_module_missing_scales_or_biases(drop):
    t = folder_tensors()
    del t[f"model.layers.0.mlp.switch_mlp.up_proj.{drop}"]
    with pytest.raises(CheckpointError, match=f"up_proj.{drop} is missing") as e:
        mlx_tensors(t, config(), CONFIG)
    assert e.value.file == FILE and e.value.tensor == "model.layers.0.mlp.switch_mlp.up_proj.weight"


def test_scales_without_a_weight():
    t = folder_tensors()
    del t["model.layers.0.self_attn.q_proj.weight"]
    with pytest.raises(CheckpointError, match="has no model.layers.0.self_attn.q_proj.weight") as e:
        mlx_tensors(t, config(), CONFIG)
    assert e.value.tensor in ("model.layers.0.self_attn.q_proj.scales", "model.layers.0.self_attn.q_proj.biases")


@pytest.mark.parametrize("quant,tensor", [
    (dict(bits=8), "model.layers.0.self_attn.q_proj.weight"),  # the default contradicts the 4-bit tensors
    (dict(group_size=32), "model.layers.0.self_attn.q_proj.weight"),
    ({"model.layers.0.mlp.gate": {"group_size": 64, "bits": 4}}, "model.layers.0.mlp.gate.weight"),  # 8-bit stored
])
def test_a_config_that_contradicts_the_tensors(quant, tensor):
    with pytest.raises(CheckpointError, match="contradicts the tensors") as e:
        mlx_tensors(folder_tensors(), config(**quant), CONFIG)
    assert e.value.tensor == tensor and e.value.file == FILE


def test_quantized_tensors_the_config_does_not_quantize():
    with pytest.raises(CheckpointError, match="has no \"quantization\"") as e:
        mlx_tensors(folder_tensors(), {"model_type": "qwen3_moe"}, CONFIG)
    assert e.value.file == FILE
    with pytest.raises(CheckpointError, match="to false") as e:
        mlx_tensors(folder_tensors(), config(**{"model.layers.0.mlp.gate": False}), CONFIG)
    assert e.value.tensor == "model.layers.0.mlp.gate.weight"


@pytest.mark.parametrize("dtype,shape", [("U8", (96, 1)), ("BF16", (48, 1))])
def test_bad_scales(dtype, shape):
    t = folder_tensors()
    t["model.layers.0.self_attn.q_proj.scales"] = _ref("model.layers.0.self_attn.q_proj.scales", dtype, shape)
    with pytest.raises(CheckpointError, match="scales must be F32/F16/BF16") as e:
        mlx_tensors(t, config(), CONFIG)
    assert e.value.tensor == "model.layers.0.self_attn.q_proj.scales"


def test_mismatched_biases():
    t = folder_tensors()
    t["model.layers.0.self_attn.q_proj.biases"] = _ref("model.layers.0.self_attn.q_proj.biases", "F32", (96, 1))
    with pytest.raises(CheckpointError, match="differ from scales"):
        mlx_tensors(t, config(), CONFIG)


@pytest.fixture(scope="module")
def mlx_lm_folder(tmp_path_factory):
    from tests.quant.mlx_files import mlx_folder

    return mlx_folder("qwen3_moe", tmp_path_factory.mktemp("mlx"), 4, 64, "bfloat16", moe_intermediate_size=64)[0]


def test_a_real_folder_with_a_contradicting_config_fails_at_load(mlx_lm_folder, tmp_path):
    """mlx-lm's own output, its config edited to claim 8 bits: a clean error at load, not wrong logits."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in mlx_lm_folder.iterdir():
        (bad / f.name).symlink_to(f)
    cfg = json.loads((mlx_lm_folder / "config.json").read_text())
    cfg["quantization"]["bits"] = 8
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(cfg))
    assert len(open_index(mlx_lm_folder)) > 0
    with pytest.raises(CheckpointError, match="bits=8 group_size=64.*contradicts the tensors") as e:
        sluice.load(bad, memory="all")
    assert e.value.file == str(bad / "model.safetensors") and e.value.tensor.endswith(".weight")


def test_mlx_experts_must_be_stacked():
    """Quantized experts one tensor per expert (not how mlx-lm writes them): an error, not codes without scales."""
    from sluice.models import model_args
    from sluice.store.layout import ExpertLayout
    from tests.models.tiny import TINY

    cfg = {**TINY["qwen3_moe"], "moe_intermediate_size": 64, "quantization": {"group_size": 64, "bits": 4}}
    t = _quantized("model.layers.0.mlp.gate", (8,), 64)
    for e in range(8):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            t.update(_quantized(f"model.layers.0.mlp.experts.{e}.{proj}", (64,), 64))
    index = CheckpointIndex(Path("/m"), cfg, None, mlx_tensors(t, cfg, CONFIG), [Path(FILE)])
    arch, args = model_args(cfg, CONFIG)
    with pytest.raises(CheckpointError, match="read stacked") as e:
        ExpertLayout(index, args.spec(), arch)
    assert e.value.tensor == "model.layers.0.mlp.experts.0.gate_proj.weight"
