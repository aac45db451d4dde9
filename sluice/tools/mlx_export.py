"""Write a Hugging Face MoE folder as an mlx-community-style affine-quantized MLX folder (`--to mlx-4bit|mlx-8bit`).

The layout is what `mlx_lm convert -q --q-bits B` writes (checked tensor by tensor in tests/test_quantize_mlx.py):
- experts stacked per projection: `model.layers.N.{mlp|block_sparse_moe}.switch_mlp.{gate,up,down}_proj` [E, out, in]
  (Mixtral keeps `block_sparse_moe`), every other tensor under its Hugging Face name (lm_head dropped when tied);
- each quantized module as `weight` (uint32, 32/B values per word, little end first), `scales` and `biases` (one per
  group of 64 along the input dimension, in the checkpoint's dtype): every 2-D+ `.weight` whose rows are whole groups
  (Linear, Embedding and the expert stacks, as mlx-lm quantizes every module with `to_quantized`); norms and the
  qwen2_moe attention biases stay as they are;
- qwen3_moe's routers (`mlp.gate`) in 8 bits, mlx-lm's quant_predicate for that model (the other three have none);
  glm4_moe's routers unquantized (mlx-lm holds them as plain arrays, not Linear modules);
- config.json = the source's plus `quantization` (and its copy `quantization_config`): {group_size, bits, mode:
  affine, "<module path>": {group_size, bits} per override}; the tokenizer and generation files copied.
- the Gated DeltaNet hybrids as mlx-lm's `sanitize` leaves them: the values it maps mapped (the architecture's
  MLX_VALUES: zero-centred norms stored as 1 + w), the conv as MLX's [C, K, 1], the shared expert gate (and the
  routers) in 8 bits (its quant_predicate), the mtp head and the vision tower left out (its models hold neither).

The numbers come from MLX's own quantizer (`mx.quantize`, on the checkpoint's own dtype as mlx-lm does), so this needs
the `mlx` package (`pip install 'mlx[cpu]'` on Linux). Streaming: one tensor or expert stack at a time, written in
shards of at most `max_shard_bytes` (checkpoint/index.py write_sharded) into OUT.partial, renamed at the end.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checkpoint.index import CONFIG, CheckpointIndex, write_sharded
from ..checkpoint.ref import STORED, stored_as
from ..errors import SluiceError
from ..quant.tensor import read_tensor
from ..models import get_arch, model_args
from ..models.spec import Spec
from ..store.layout import moe_prefix
from ..plan import open_index

GROUP_SIZE = 64  # mlx-lm's default for affine quantization
_HYBRIDS = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
_UNREAD = ("mtp.", "model.visual.")  # a hub hybrid's mtp head and vision tower: mlx-lm's sanitize drops them
# mlx-lm's vision-language wrappers name the text model `language_model.model.*` (and quantization paths so)
_VLM = {"qwen3_5_moe": "language_model."}
MLX_TYPES = {"mlx-4bit": 4, "mlx-8bit": 8}

def _mx():
    try:
        import mlx.core as mx
    except ImportError:
        raise SluiceError("MLX output needs the mlx package (its quantizer makes the numbers): pip install "
                          "'mlx[cpu]' (Linux) or pip install mlx (macOS)") from None
    return mx


def _to_mx(t: torch.Tensor):
    mx = _mx()
    if t.dtype == torch.bfloat16:
        return mx.array(t.contiguous().view(torch.int16).numpy()).view(mx.bfloat16)
    return mx.array(t.contiguous().numpy())


def _to_torch(a) -> torch.Tensor:
    mx = _mx()
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.view(mx.int16))).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def quantize_affine(w: torch.Tensor, bits: int, group_size: int = GROUP_SIZE) -> dict[str, torch.Tensor]:
    """`mx.quantize` of `w` [..., in] in its own dtype: {"weight": uint32 [..., in*bits/32], "scales", "biases":
    [..., in/group_size] in w's dtype}."""
    mx = _mx()
    wq, scales, biases = mx.quantize(_to_mx(w), group_size=group_size, bits=bits)
    return {"weight": _to_torch(wq), "scales": _to_torch(scales), "biases": _to_torch(biases)}


def _module_tensors(index: CheckpointIndex) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(MLX name, loader) of every tensor in mlx-lm's naming, experts stacked; nothing is read until called."""
    cfg = index.config
    arch = get_arch(cfg.get("model_type"), index.folder / CONFIG)
    _, args = model_args(cfg, index.folder / CONFIG)
    spec = args.spec()
    expert_names = {}
    for n, sparse in enumerate(spec.moe_layers):
        if not sparse:
            continue
        src = moe_prefix(index, arch, n)
        dst = f"model.layers.{n}.{arch.MLX_MOE}"
        expert_names[src] = dst
    E = spec.num_experts
    pre = _VLM.get(cfg.get("model_type"), "")
    scales = {f"{n}_scale_inv" for n, ref in index.tensors.items() if ref.fp8 is not None}
    for name in index.tensors:
        moe = next((p for p in expert_names if name.startswith(p + ".")), None)
        if moe is not None and name.startswith(f"{moe}.experts."):
            continue  # stacked below
        if (name == "lm_head.weight" and spec.tie_word_embeddings) or "rotary_emb" in name or name.startswith(_UNREAD):
            continue
        if name in scales:  # an FP8 weight's block scales: read_tensor dequantized the weight with them
            continue
        mlx_name = f"{expert_names[moe]}.gate.weight" if moe and name == f"{moe}.gate.weight" else name
        yield pre + mlx_name, lambda name=name: _sanitized(name, read_tensor(index[name]), arch)
    for src, dst in expert_names.items():
        if f"{src}.experts.gate_up_proj" in index:
            I = spec.moe_intermediate_size
            gu = lambda src=src: read_tensor(index[f"{src}.experts.gate_up_proj"])  # noqa: E731 [E, 2I, H]
            yield f"{pre}{dst}.switch_mlp.gate_proj.weight", lambda gu=gu: gu()[:, :I]
            yield f"{pre}{dst}.switch_mlp.up_proj.weight", lambda gu=gu: gu()[:, I:]
            yield (f"{pre}{dst}.switch_mlp.down_proj.weight",
                   lambda src=src: read_tensor(index[f"{src}.experts.down_proj"]))
            continue
        for hf, mlx in zip(arch.EXPERT_PROJ, ("gate_proj", "up_proj", "down_proj")):
            yield (f"{pre}{dst}.switch_mlp.{mlx}.weight",
                   lambda src=src, hf=hf: torch.stack([read_tensor(index[f"{src}.experts.{e}.{hf}.weight"])
                                                       for e in range(E)]))


def _sanitized(name: str, t: torch.Tensor, arch) -> torch.Tensor:
    """`t` as mlx-lm's sanitize leaves it: its value maps applied (MLX_VALUES), a depthwise conv [C, 1, K] as MLX's
    [C, K, 1] (the same elements in the same order)."""
    how = stored_as(name, arch.MLX_VALUES)
    if how:
        t = STORED[how].store(t.float()).to(t.dtype)
    if name.endswith("conv1d.weight") and t.dim() == 3 and t.shape[1] == 1:
        t = t.reshape(t.shape[0], t.shape[2], 1)
    return t


def _override(path: str, model_type: str) -> dict[str, int] | None:
    """mlx-lm's per-module parameters: the quant_predicate of qwen3_moe puts the routers (`*.mlp.gate`) in 8 bits,
    the hybrids' the routers and the shared expert gates (the config records them even when the default is 8 bits
    too)."""
    eight = {"group_size": GROUP_SIZE, "bits": 8}
    if model_type == "qwen3_moe" and path.endswith("mlp.gate"):
        return eight
    if model_type in _HYBRIDS and path.endswith(("mlp.gate", "shared_expert_gate")):
        return eight
    return None


def _kept_plain(path: str, spec: Spec) -> bool:
    """Modules mlx-lm never quantizes although their weight is 2-D: the grouped sigmoid routers (glm4_moe's
    MoEGate holds `gate.weight` as a plain array, which nn.quantize skips)."""
    return spec.router == "sigmoid_grouped" and path.endswith(".mlp.gate")


def mlx_stream(index: CheckpointIndex, bits: int, quantization: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of the MLX folder; records per-module overrides into `quantization`."""
    model_type = index.config["model_type"]
    spec = model_args(index.config, index.folder / CONFIG)[1].spec()
    for name, load in _module_tensors(index):
        t = load()
        path = name.removesuffix(".weight")
        if (name.endswith(".weight") and t.dim() >= 2 and t.shape[-1] % GROUP_SIZE == 0
                and not _kept_plain(path, spec)):
            override = _override(path, model_type)
            if override is not None:
                quantization[path] = override
            for part, value in quantize_affine(t, override["bits"] if override else bits).items():
                yield f"{path}.{part}", value
        else:
            yield name, t
        del t


def planned_bytes(model: str | os.PathLike[str], bits: int) -> int:
    """About the bytes export_mlx writes (the routers' 8 bits aside): for a progress bar."""
    total = 0
    for ref in open_index(model).tensors.values():
        n = int(np.prod(ref.shape))
        if ref.name.endswith(".weight") and len(ref.shape) >= 2 and ref.shape[-1] % GROUP_SIZE == 0:
            total += n * bits // 8 + 2 * (n // GROUP_SIZE) * (ref.nbytes // max(n, 1))
        else:
            total += ref.nbytes
    return total


def export_mlx(model: str | os.PathLike[str], out: str | os.PathLike[str], bits: int, force: bool = False,
               progress: Callable[[int], None] | None = None, max_shard_bytes: int = 2**30) -> dict[str, Any]:
    """Write `model` (a supported HF MoE folder) as an MLX affine `bits`-bit folder at `out` (see the module doc).

    `progress(nbytes)` after each tensor written. Returns a summary: path, bytes, bits, group_size, tensors."""
    from .output import Tally, copy_side_files, writing_model

    if bits not in MLX_TYPES.values():
        raise SluiceError(f"MLX bits {bits}: 4 or 8")
    _mx()
    folder, out = Path(model), Path(out)
    index = open_index(folder)
    model_args(index.config, folder / CONFIG)  # a ConfigError before anything is written
    quantization: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
    tensors = Tally(mlx_stream(index, bits, quantization), progress)
    with writing_model(out, force) as partial:
        files = write_sharded(partial, tensors, max_shard_bytes)
        config = dict(index.config)
        config["quantization"] = quantization
        config["quantization_config"] = quantization
        (partial / CONFIG).write_text(json.dumps(config, indent=4) + "\n", "utf-8")
        copy_side_files(folder, partial)
    size = sum((out / f.name).stat().st_size for f in files)
    return {"path": str(out), "bytes": size, "bits": bits, "group_size": GROUP_SIZE, "tensors": tensors.count,
            "type": f"mlx-{bits}bit", "fallbacks": []}
