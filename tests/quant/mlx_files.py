"""Real MLX folders for tests, written by mlx-lm's own converter, and the references computed from them.

`mlx_folder` saves a tiny random transformers model as a Hugging Face folder and runs `mlx_lm.convert` on it (the
tool that makes mlx-community's folders), so sluice is tested on mlx-lm's layout, not on its own writer's. The
references: mlx-lm's logits and greedy tokens with its scales and biases widened to float32 (mlx-lm computes in the
scales' dtype; widened, it computes on exactly the values sluice's float32 path uses), and transformers on the
`mx.dequantize`d weights.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import sluice
from tests.models.tiny import hf_model, write_checkpoint

DEMO = Path(sluice.__file__).parent / "assets" / "demo"  # a tokenizer for the converter (it loads one; ids only matter)

# What mlx-lm's model files implement, so its logits can be a reference: no sliding window (mixtral, qwen2_moe),
# no clip_qkv (olmoe), no dense layers nor yarn rope in qwen2_moe, and an lm_head it can load (qwen2_moe).
MLX_COMPATIBLE = {
    "qwen3_moe": {},
    "mixtral": dict(sliding_window=None),
    "olmoe": dict(clip_qkv=None),
    "qwen2_moe": dict(use_sliding_window=False, mlp_only_layers=[], tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "qwen3_next": {},  # its dense layer and unnormalised top-k included
    "qwen3_5_moe": {},  # the hub's wrapper (mlx-lm keeps the text model); experts fused, as its sanitize reads them
}
LAYOUT = {"qwen3_5_moe": "fused"}  # the HF layout mlx-lm converts (per expert otherwise)


def mlx_folder(arch: str, out: Path, bits: int | None, group_size: int, dtype: str, **overrides
               ) -> tuple[Path, object]:
    """(an MLX folder converted by mlx-lm from a tiny random `arch` model, that transformers model); bits None:
    converted without quantization (mlx-lm's names and stacked experts, plain weights)."""
    convert = pytest.importorskip("mlx_lm.convert", reason="mlx-lm is not installed (pip install mlx-lm)").convert
    model = hf_model(arch, **{**MLX_COMPATIBLE[arch], **overrides})
    hf = write_checkpoint(model, out / "hf", LAYOUT.get(arch, "per_expert"))
    config = json.loads((hf / "config.json").read_text())
    # transformers 5 writes rope_parameters and num_local_experts; mlx-lm reads rope_theta and num_experts (and
    # qwen3_next's partial_rotary_factor at the top)
    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    config.setdefault("num_experts", config.get("num_local_experts"))
    if "partial_rotary_factor" in rope:
        config.setdefault("partial_rotary_factor", rope["partial_rotary_factor"])
    # mlx-lm places the hybrids' attention layers by full_attention_interval (default 4), which the hub's configs
    # hold and transformers 5 folds into layer_types
    text = config.get("text_config", config)
    if "layer_types" in text and "full_attention_interval" not in text:
        text["full_attention_interval"] = text["layer_types"].index("full_attention") + 1
    (hf / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, hf / name)
    with contextlib.redirect_stdout(io.StringIO()):  # its progress lines
        convert(str(hf), str(out / "mlx"), quantize=bits is not None, q_group_size=group_size, q_bits=bits,
                dtype=dtype)
    return out / "mlx", model


def mlx_lm_float32(folder: Path):
    """mlx-lm's model of `folder` with every floating-point parameter (norms, scales, biases) widened to float32."""
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(folder))
    model.set_dtype(mx.float32)
    return model


def mlx_lm_logits(model, ids: list[int]) -> torch.Tensor:
    import mlx.core as mx

    return torch.from_numpy(np.array(model(mx.array([ids]))[0].astype(mx.float32)))  # [T, vocab]


def mlx_lm_greedy(model, ids: list[int], n: int) -> list[int]:
    """mlx-lm's greedy continuation (generate_step's default sampler is argmax)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]


def dequantized_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """The MLX folder's weights under transformers 5 names, every quantized module `mx.dequantize`d in float32
    (scales and biases widened first), the stacked experts as transformers' fused gate_up_proj / down_proj."""
    import mlx.core as mx

    w = {}
    for f in sorted(folder.glob("*.safetensors")):
        w.update(mx.load(str(f)))
    q = json.loads((folder / "config.json").read_text())["quantization"]
    sd = {}
    for name, t in w.items():
        module, _, kind = name.rpartition(".")
        if kind in ("scales", "biases"):
            continue
        if kind == "weight" and f"{module}.scales" in w:  # not a Linear's own `bias`
            p = q.get(module, q)
            f32 = mx.float32
            t = mx.dequantize(t, w[f"{module}.scales"].astype(f32), w[f"{module}.biases"].astype(f32),
                              group_size=p["group_size"], bits=p["bits"])
        sd[name.replace(".block_sparse_moe.", ".mlp.")] = torch.from_numpy(np.array(t.astype(mx.float32)))
    for name in [n for n in sd if ".switch_mlp.gate_proj." in n]:
        p = name.split(".switch_mlp.")[0]
        gate, up = sd.pop(name), sd.pop(f"{p}.switch_mlp.up_proj.weight")
        sd[f"{p}.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)  # [E, 2I, H], gate rows first
        sd[f"{p}.experts.down_proj"] = sd.pop(f"{p}.switch_mlp.down_proj.weight")  # [E, H, I]
    return sd
