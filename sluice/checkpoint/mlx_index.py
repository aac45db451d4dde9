"""MLX folders (mlx-lm's `convert`, the mlx-community layout) presented with sluice's tensor names.

An MLX folder is a Hugging Face folder (config.json, model.safetensors or shards + index) written after mlx-lm's
`sanitize` and `nn.quantize`:

- experts stacked per layer: `{p}.switch_mlp.{gate_proj,up_proj,down_proj}.weight` [E, out, in] (p = `model.layers.N
  .mlp`, Mixtral `model.layers.N.block_sparse_moe`); presented as `{p}.experts.{gate,up,down}_proj` [E, out, in],
  the stacked layout store/layout.py reads (one contiguous slice per expert);
- a quantized Linear or Embedding `M` is three tensors: `M.weight` uint32 [..., out, in * bits / 32] (packed codes),
  `M.scales` and `M.biases` [..., out, in / group_size] (F32 / F16 / BF16); presented as one ref `M.weight` of
  logical shape [..., out, in] carrying the other two (TensorRef.mlx), so shapes check against config.json as for
  any checkpoint; read_tensor dequantizes it, the expert layout streams its three byte ranges per expert;
- config.json `quantization`: {"group_size", "bits", "mode"} for every quantized module, except modules named by
  their path with their own {"group_size", "bits"} (mlx-lm keeps MoE routers at 8 bits this way) or `false`.
  mlx-lm's converter leaves a Linear unquantized when its input size is not a multiple of the group size: such a
  module has a plain `weight` and no scales.

Every quantized module is checked against the config: its weight, scales and biases present, floating-point scales
and biases of one dtype, and packed widths that are exactly the configured bits and group size.

mlx-lm's `sanitize` of some architectures changes values too (the Gated DeltaNet hybrids: zero-centred norms stored
as their scale 1 + w); the architecture names them (models/<model_type>.py MLX_VALUES, handed down by the opener)
and their refs carry TensorRef.values. Its vision-language wrappers (Qwen3.5) name the text model
`language_model.model.*` and its head `language_model.lm_head`: presented as `model.*` and `lm_head`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path

from ..errors import CheckpointError
from .formats import MLX_BITS as BITS
from .ref import MLXQuant, TensorRef, stored_as

GROUP_SIZES = (32, 64, 128)  # what mlx.core.quantize accepts for affine quantization (mlx 0.32)
_SWITCH_RE = re.compile(r"(?P<p>.+)\.switch_mlp\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<kind>weight|scales|biases)")
_FLOAT = ("F32", "F16", "BF16")
_VLM_PREFIX = "language_model."
_REDO = "re-convert it with mlx_lm.convert (or re-download it)"


def is_mlx(config: dict, tensors: dict[str, TensorRef]) -> bool:
    """An MLX folder: config.json has mlx-lm's `quantization`, or the experts are stacked as mlx-lm's switch_mlp."""
    return "quantization" in config or any(".switch_mlp." in name for name in tensors)


def mlx_tensors(tensors: dict[str, TensorRef], config: dict, config_path: Path,
                values: Mapping[str, str] | None = None) -> dict[str, TensorRef]:
    """The folder's tensors under sluice's names: a quantized module's `weight` ref carries its scales and biases
    (TensorRef.mlx), which stay listed under their own names too (their files and bytes are part of the checkpoint);
    stacked experts are renamed to `{p}.experts.{proj}`; the tensors `values` names (sluice name or suffix -> a
    ref.STORED key: what mlx-lm's sanitize did to them) carry it. CheckpointError for a module the config and the
    tensors disagree on."""
    quant = _parse_quantization(config.get("quantization"), config_path)
    table = dict(values or {})
    out: dict[str, TensorRef] = {}
    for name, ref in tensors.items():
        module, _, kind = name.rpartition(".")
        if kind in ("scales", "biases"):
            if f"{module}.weight" not in tensors:
                raise CheckpointError(f"has no {module}.weight to scale; the folder is incomplete: {_REDO}",
                                      file=ref.path, tensor=name)
        elif kind == "weight" and (f"{module}.scales" in tensors or ref.dtype == "U32"):
            ref = _quantized(module, tensors, quant, config_path)
        new = _sluice_name(name)
        if stored_as(new, table):
            ref = dataclasses.replace(ref, values=stored_as(new, table))
        out[new] = ref
    return out


def _sluice_name(name: str) -> str:
    if name.startswith(_VLM_PREFIX):  # mlx-lm's vision-language wrapper: language_model.model.*, language_model.lm_head
        name = name[len(_VLM_PREFIX):]
    m = _SWITCH_RE.fullmatch(name)
    if m is None:
        return name
    return f"{m['p']}.experts.{m['proj']}" + ("" if m["kind"] == "weight" else f".{m['kind']}")


def _parse_quantization(q: object, config_path: Path) -> dict | None:
    """config.json `quantization` -> {"default": (bits, group_size), module path: (bits, group_size) or None}."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"\"quantization\" must be an object like {{\"group_size\": 64, \"bits\": 4}}, got "
                              f"{q!r}; {_REDO}", file=str(config_path))
    out: dict = {"default": _params(q, "quantization", config_path)}
    for key, value in q.items():
        if key in ("group_size", "bits", "mode"):
            continue
        if value is False:
            out[key] = None
        elif value is True:
            out[key] = out["default"]
        elif isinstance(value, dict):
            out[key] = _params(value, f"quantization.{key}", config_path)
        else:
            raise CheckpointError(f"\"quantization\" entry {key!r} must be an object {{\"group_size\", \"bits\"}} "
                                  f"or false, got {value!r}; {_REDO}", file=str(config_path))
    return out


def _params(q: dict, where: str, config_path: Path) -> tuple[int, int]:
    mode = q.get("mode", "affine")
    if mode != "affine":
        raise CheckpointError(f"{where}.mode is {mode!r}; sluice reads MLX affine quantization only (mlx_lm.convert "
                              "-q without --q-mode)", file=str(config_path))
    bits, group = q.get("bits"), q.get("group_size")
    if type(bits) is not int or bits not in BITS:
        raise CheckpointError(f"{where}.bits is {bits!r}; sluice reads MLX affine {', '.join(map(str, BITS))} bits: "
                              f"{_REDO} --q-bits 4 or 8", file=str(config_path))
    if type(group) is not int or group not in GROUP_SIZES:
        raise CheckpointError(f"{where}.group_size is {group!r}; MLX affine groups are "
                              f"{', '.join(map(str, GROUP_SIZES))}: {_REDO} --q-group-size 64",
                              file=str(config_path))
    return bits, group


def _quantized(module: str, tensors: dict[str, TensorRef], quant: dict | None, config_path: Path) -> TensorRef:
    """The `weight` ref of quantized module `module`, its logical shape checked against its scales and the config."""
    w = tensors[f"{module}.weight"]
    params = None if quant is None else quant.get(module, quant["default"])
    if params is None:
        why = "has no \"quantization\"" if quant is None else f"sets \"quantization\" {module!r} to false"
        raise CheckpointError(f"is stored quantized ({w.dtype}{', with scales' if f'{module}.scales' in tensors else ''})"
                              f" but {config_path.name} {why}; the config contradicts the tensors: {_REDO}",
                              file=w.path, tensor=w.name)
    bits, group = params
    parts = {}
    for kind in ("scales", "biases"):
        ref = tensors.get(f"{module}.{kind}")
        if ref is None:
            raise CheckpointError(f"is quantized but {module}.{kind} is missing; the folder is incomplete: {_REDO}",
                                  file=w.path, tensor=w.name)
        if ref.dtype not in _FLOAT or ref.shape[:-1] != w.shape[:-1] or len(ref.shape) < 2:
            raise CheckpointError(f"{kind} must be F32/F16/BF16 [{', '.join(map(str, w.shape[:-1]))}, groups] for "
                                  f"weight {list(w.shape)}, got {ref.dtype} {list(ref.shape)}; {_REDO}",
                                  file=ref.path, tensor=ref.name)
        parts[kind] = ref
    s, b = parts["scales"], parts["biases"]
    if (s.dtype, s.shape) != (b.dtype, b.shape):
        raise CheckpointError(f"biases {b.dtype} {list(b.shape)} differ from scales {s.dtype} {list(s.shape)}; "
                              f"{_REDO}", file=b.path, tensor=b.name)
    in_features = s.shape[-1] * group
    if w.dtype != "U32" or w.shape[-1] * 32 != in_features * bits:
        stored = f"{w.shape[-1] * 32 / in_features:g}" if w.dtype == "U32" else "not uint32-packed"
        raise CheckpointError(
            f"{config_path.name} \"quantization\" gives {module!r} bits={bits} group_size={group}, so its "
            f"{s.shape[-1]} groups are {in_features} inputs needing uint32 weight [..., {in_features * bits // 32}], "
            f"but the weight is {w.dtype} {list(w.shape)} ({stored} bits at that group size); the config contradicts "
            f"the tensors: {_REDO}", file=w.path, tensor=w.name)
    return dataclasses.replace(w, dtype=f"mlx{bits}", shape=(*w.shape[:-1], in_features),
                               mlx=MLXQuant(bits, group, s, b))
