"""FP8 block-quantized folders (DeepSeek-V3 / R1, Kimi K2, the Qwen3 FP8 uploads) presented with each weight's scales.

Such a folder is a Hugging Face folder whose config.json (or its text_config) has

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "modules_to_not_convert": [...]}

and whose quantized Linears are two tensors: `M.weight` F8_E4M3 [..., out, in] and `M.weight_scale_inv`
[..., ceil(out / 128), ceil(in / 128)] (F32; BF16 or F16 in some Qwen3 uploads); transformers' own fused expert
stacks name the pair `P` and `P_scale_inv`. Each pair is presented as one ref `M.weight` (dtype "fp8_e4m3") carrying
its scales (TensorRef.fp8), so shapes check against config.json as for any checkpoint; quant/tensor.py read_tensor
dequantizes it, the expert layout streams its two byte ranges per expert, and resident projections may keep both
(quant/linear.py). The scales stay listed under their own names too: their bytes are part of the checkpoint.

Which weights are FP8 is read from the tensors (an F8_E4M3 weight and its scales), as transformers' dequantizing
load on a CPU does (it dequantizes every weight that has a scale, whatever `modules_to_not_convert` /
`ignored_layers` say: those lists tell a GPU loader which modules to leave as plain Linears). Embeddings, norms,
routers and lm_head ship in BF16 and are read as such. `activation_scheme` says how a GPU quantizes activations
(per token and block, "dynamic", or with stored `input_scale`s, "static"): the reference computes on the
dequantized weights in float32 and so does sluice, so both are read and the activation scales left unused.

Refused, each with a CheckpointError naming the field or tensor: an fp8 format other than e4m3, per-tensor scales
(weight_block_size null), UE8M0 scales (scale_fmt "ue8m0", DeepSeek-V4) or FP4 experts (expert_dtype "fp4"), a
block whose inputs are not whole groups of 32, an F8_E4M3 weight without its scales, scales without their weight
or of the wrong shape or dtype, and scales in a folder whose config.json does not say it is FP8.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..errors import CheckpointError
from .ref import FP8Quant, TensorRef

SCALE = "_scale_inv"  # `weight_scale_inv` beside `weight`; transformers' fused stacks: `gate_up_proj_scale_inv`
_SCALE_DTYPES = ("F32", "BF16", "F16")
_REDO = "re-download the folder (or re-export it: sluice quantize SRC OUT --to fp8)"


def fp8_config(config: dict, config_path: Path) -> tuple[int, int] | None:
    """The weight block (rows, inputs) of a config.json whose quantization_config is quant_method "fp8", None for a
    config without one (or of another method: gpt-oss's mxfp4 has its own reader); CheckpointError naming the field
    for a variant sluice does not read."""
    q = config.get("quantization_config")
    if not isinstance(q, dict) or str(q.get("quant_method", "")).lower() != "fp8":
        return None

    def refuse(field: str, why: str) -> CheckpointError:
        return CheckpointError(f"quantization_config.{field}: {why}", file=str(config_path))

    fmt = q.get("fmt", "e4m3")
    if str(fmt).lower() != "e4m3":
        raise refuse("fmt", f"{fmt!r}; sluice reads FP8 weights in e4m3 (float8_e4m3fn), as DeepSeek-V3, Kimi K2 "
                            "and the Qwen3 FP8 uploads ship them: use a bf16 or GGUF version of this model")
    scheme = q.get("activation_scheme", "dynamic")
    if str(scheme).lower() not in ("dynamic", "static"):
        raise refuse("activation_scheme", f"{scheme!r} is neither \"dynamic\" nor \"static\"")
    if q.get("scale_fmt", "float") != "float":
        raise refuse("scale_fmt", f"{q['scale_fmt']!r}; sluice reads float block scales (F32 / BF16 / F16 "
                                  "weight_scale_inv), not power-of-two UE8M0 ones: use a bf16 or GGUF version")
    if q.get("expert_dtype", "fp8") != "fp8":
        raise refuse("expert_dtype", f"{q['expert_dtype']!r}; sluice reads FP8 experts only: use a GGUF version")
    for key in ("modules_to_not_convert", "ignored_layers"):
        names = q.get(key)
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise refuse(key, f"must be a list of module names, got {names!r}")
    block = q.get("weight_block_size")
    if block is None:
        raise refuse("weight_block_size", "null (one scale per tensor); sluice reads block scales "
                                          "(weight_block_size [128, 128], as the hub's FP8 uploads have)")
    if (not isinstance(block, (list, tuple)) or len(block) != 2 or not all(type(b) is int and b > 0 for b in block)
            or block[1] % 32 or block[0] >= 2**23):
        raise refuse("weight_block_size", f"{block!r}; sluice reads blocks [rows, inputs] of positive sizes whose "
                                          "inputs are whole groups of 32 (the hub's are [128, 128])")
    return block[0], block[1]


def has_fp8_scales(tensors: dict[str, TensorRef]) -> bool:
    """Whether the folder stores FP8 block scales (some `*_scale_inv` tensor beside a weight)."""
    return any(n.endswith(SCALE) for n in tensors)


def fp8_tensors(tensors: dict[str, TensorRef], config: dict, config_path: Path) -> dict[str, TensorRef]:
    """The folder's tensors with each FP8 weight's ref carrying its scales (TensorRef.fp8, dtype "fp8_e4m3"); the
    scales stay listed. Unchanged for a folder that is not FP8 (config.json without quant_method "fp8" and no
    scales). CheckpointError for a config or tensor sluice cannot read (see the module doc)."""
    block = fp8_config(config, config_path)
    if block is None:
        if has_fp8_scales(tensors):
            name = next(n for n in tensors if n.endswith(SCALE))
            ref = tensors[name]
            raise CheckpointError(f"is an FP8 block scale, but {config_path.name} has no quantization_config with "
                                  f"quant_method \"fp8\": the config contradicts the tensors; {_REDO}",
                                  file=ref.path, tensor=name)
        return tensors
    out = dict(tensors)
    for name, ref in tensors.items():
        if name.endswith(SCALE):
            weight = tensors.get(name[: -len(SCALE)])
            if weight is None:
                raise CheckpointError(f"has no {name[: -len(SCALE)]} to scale; the folder is incomplete: {_REDO}",
                                      file=ref.path, tensor=name)
        elif ref.dtype == "F8_E4M3":
            out[name] = _scaled(name, ref, tensors, block, config_path)
        elif ref.dtype == "F8_E5M2":
            raise CheckpointError(f"is stored as F8_E5M2; sluice reads FP8 weights in e4m3 (F8_E4M3) only: use a bf16 "
                                  "or GGUF version of this model", file=ref.path, tensor=name)
    return out


def _scaled(name: str, w: TensorRef, tensors: dict[str, TensorRef], block: tuple[int, int],
            config_path: Path) -> TensorRef:
    """The ref of FP8 weight `name` carrying its scales, checked against the weight and the block size."""
    s = tensors.get(name + SCALE)
    if s is None:
        raise CheckpointError(f"is stored as F8_E4M3 but {name}{SCALE} (its block scales) is missing; without them "
                              f"its values are unknown: the folder is incomplete, {_REDO}", file=w.path, tensor=name)
    if len(w.shape) < 2:
        raise CheckpointError(f"is an FP8 weight of shape {list(w.shape)}; FP8 weights are [..., out, in]: {_REDO}",
                              file=w.path, tensor=name)
    *lead, rows, cols = w.shape
    grid = (*lead, -(-rows // block[0]), -(-cols // block[1]))
    if s.dtype not in _SCALE_DTYPES or tuple(s.shape) != grid:
        raise CheckpointError(
            f"must be F32 / BF16 / F16 {list(grid)}: one scale per block of {block[0]} x {block[1]} weights of "
            f"{name} {list(w.shape)} ({config_path.name} quantization_config.weight_block_size {list(block)}), got "
            f"{s.dtype} {list(s.shape)}; the config contradicts the tensors: {_REDO}", file=s.path, tensor=s.name)
    return dataclasses.replace(w, dtype="fp8_e4m3", fp8=FP8Quant(block, s))
