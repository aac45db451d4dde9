"""Tiny FP8 folders in the hub's layout, and transformers' reading of them as the reference.

`fp8_folder` writes a transformers model (tests/models/tiny.py, shapes made to span several 128 x 128 blocks) with
save_pretrained, then `sluice quantize --to fp8` (tools/fp8_export.py) quantizes its linear weights to e4m3 with
block scales as DeepSeek-V3 / Qwen3 FP8 uploads are.

`transformers_fp8` is the reference: the folder's weights dequantized by transformers' own FP8 code in float32 and
loaded into its model. On a CPU, `from_pretrained` of an FP8 folder dequantizes every weight with its scales
(FineGrainedFP8HfQuantizer falls back to `dequantize=True`; the op is `Fp8Dequantize`, in the dtype the model
loads in); it needs the accelerate package, which the test environment lacks, so the same op runs here on the
folder's tensors and the model loads the float32 result (`from_pretrained` of the FP8 folder itself gives bitwise
its logits where accelerate is installed: tests/quant/test_fp8_models.py). `Fp8Dequantize` derives each block from
the scale grid (rows // scale rows), which is DeepSeek's block only when every dimension is a multiple of 128 or less;
`blockwise=True` dequantizes with transformers' `_dequantize_fp8_weight` instead (its FP8 layers' backward: the
configured block, the last one partial, as DeepSeek's own weight_dequant), for shapes where the two differ.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.models.tiny import hf_model, write_checkpoint

# shapes that span several blocks: every FP8 dimension a multiple of 128 or below it (where transformers' load-time
# dequantization and DeepSeek's blocks agree), or, for "ragged", partial last blocks (192 = 128 + 64, 160, 320)
FP8_CASES = {
    "deepseek_v3": ("deepseek_v3", dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
                                        q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                                        v_head_dim=16)),
    "qwen3_moe": ("qwen3_moe", dict(hidden_size=256, head_dim=32, moe_intermediate_size=128, intermediate_size=384)),
    "qwen3_moe-ragged": ("qwen3_moe", dict(hidden_size=192, head_dim=48, moe_intermediate_size=160,
                                           intermediate_size=320)),
}


def fp8_folder(case: str, tmp: Path, scale_dtype: torch.dtype = torch.float32) -> Path:
    """The FP8 folder of FP8_CASES[case] under tmp (its source, a float32 save_pretrained folder, in tmp / "hf")."""
    from sluice.tools.fp8_export import export_fp8

    arch, overrides = FP8_CASES[case]
    model = hf_model(arch, **overrides)
    src = write_checkpoint(model, tmp / "hf", "per_expert")
    export_fp8(src, tmp / "fp8", scale_dtype=scale_dtype)
    return tmp / "fp8"


def dequantized_tensors(folder: Path, blockwise: bool = False) -> dict[str, torch.Tensor]:
    """The folder's tensors with every FP8 weight dequantized by transformers in float32 (its scales dropped)."""
    from safetensors.torch import load_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    block = json.loads((folder / "config.json").read_text())["quantization_config"]["weight_block_size"]
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        s = tensors.get(name + "_scale_inv")
        if s is None:
            out[name] = t
        elif blockwise:
            out[name] = _dequantize_fp8_weight(t, s, block, torch.float32)
        else:
            out[name] = Fp8Dequantize(None)._dequantize_one(t, s, output_dtype=torch.float32)
    return out


def transformers_fp8(folder: Path, tmp: Path, blockwise: bool = False):
    """transformers' float32 model of the FP8 folder (see the module doc)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out = tmp / "dequantized"
    out.mkdir(exist_ok=True)
    save_file(dequantized_tensors(folder, blockwise), out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
