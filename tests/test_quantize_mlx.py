"""`sluice quantize --to mlx-4bit|mlx-8bit`: the folder `mlx_lm convert -q` writes, tensor for tensor and bit for bit
(names, stacked experts, uint32 packing, scales/biases, 8-bit qwen3_moe routers, config `quantization`), and mlx-lm
loads it and computes the same logits as from its own conversion. Skipped without mlx-lm (CI may not have it)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("mlx.core", reason="MLX output needs mlx (pip install 'mlx[cpu]')")
mlx_lm = pytest.importorskip("mlx_lm", reason="the reference is mlx-lm's own converter (pip install mlx-lm)")

from safetensors.torch import load_file  # noqa: E402

from sluice import cli  # noqa: E402
from sluice.tools.quantize import quantize  # noqa: E402
from sluice.tools.synth import OutputExistsError, SynthConfig, make_model  # noqa: E402

IDS = list(range(3, 30))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _mlx_logits(folder) -> np.ndarray:
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(folder))
    return np.array(model(mx.array([IDS])).astype(mx.float32))[0]


@pytest.mark.parametrize("arch,bits", [("qwen3_moe", 4), ("qwen3_moe", 8), ("qwen2_moe", 4), ("olmoe", 4),
                                       ("mixtral", 4), ("glm4_moe", 4), ("qwen3_next", 4), ("qwen3_5_moe", 4)])
def test_same_folder_as_mlx_lm_convert(tmp_path, arch, bits):
    """The hybrids as mlx-lm's sanitize leaves them too: norms as 1 + w, the conv [C, K, 1], 8-bit routers and shared
    expert gates, Qwen3.5's text model as language_model.model.*, no mtp head nor vision tower. (mlx-lm converts
    Qwen3.5's fused experts only: that layout.)"""
    from mlx_lm.convert import convert

    sc = SynthConfig(arch=arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     num_experts=4, top_k=2, moe_intermediate_size=64, vocab_size=320,
                     layout="fused" if arch == "qwen3_5_moe" else "per_expert")
    src = make_model(tmp_path / "src", sc, progress=False)
    convert(str(src), str(tmp_path / "ref"), quantize=True, q_bits=bits)
    summary = quantize(src, tmp_path / "ours", f"mlx-{bits}bit")
    assert summary["bits"] == bits and not (tmp_path / "ours.partial").exists()
    ours, ref = load_file(tmp_path / "ours/model.safetensors"), load_file(tmp_path / "ref/model.safetensors")
    assert sorted(ours) == sorted(ref)
    for name in ref:
        assert ours[name].dtype == ref[name].dtype and ours[name].shape == ref[name].shape, name
        assert torch.equal(_bits(ours[name]), _bits(ref[name])), name
    cfg_ours = json.loads((tmp_path / "ours/config.json").read_text())
    cfg_ref = json.loads((tmp_path / "ref/config.json").read_text())
    assert cfg_ours["quantization"] == cfg_ref["quantization"] == cfg_ours["quantization_config"]
    if arch == "qwen3_moe":  # mlx-lm's qwen3_moe keeps its routers at 8 bits
        assert cfg_ours["quantization"]["model.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}
    np.testing.assert_array_equal(_mlx_logits(tmp_path / "ours"), _mlx_logits(tmp_path / "ref"))


def test_existing_folder_needs_force(tmp_path, capsys):
    sc = SynthConfig(arch="qwen3_moe", hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                     num_experts=4, top_k=2, moe_intermediate_size=64, vocab_size=320)
    src = make_model(tmp_path / "src", sc, progress=False)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    assert cli.main(["quantize", str(src), str(tmp_path / "out"), "--to", "mlx-4bit", "--no-progress"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"sluice quantize: error: {tmp_path / 'out'} exists and is not empty; pass --force to replace it"
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]
    with pytest.raises(OutputExistsError):
        quantize(src, tmp_path / "out", "mlx-8bit")
