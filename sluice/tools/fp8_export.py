"""Write a Hugging Face MoE folder as an FP8 block-quantized folder (`sluice quantize SRC OUT --to fp8`), in the layout
of the hub's FP8 uploads (DeepSeek-V3 / R1, Kimi K2, Qwen3-30B-A3B-FP8):

- each quantized Linear `M` as `M.weight` F8_E4M3 [out, in] and `M.weight_scale_inv` [ceil(out/128), ceil(in/128)]
  (F32 by default, as DeepSeek's; BF16 as some Qwen3 uploads with scale_dtype), made by quant/fp8.py quantize_fp8:
  per 128 x 128 block, scale = amax / 448 and codes = w / scale rounded to e4m3;
- quantized: the attention projections (q / k / v / o, latent attention's q_a / q_b / kv_a / kv_b), the dense and
  shared-expert MLPs, every routed expert (per expert, as the hub stores them) and the Gated DeltaNet input
  projections but their b / a parts; kept as they are: embeddings, norms, biases, routers (and a shared expert's
  gate), lm_head, and whatever the model does not read (an mtp head, a vision tower);
- config.json = the source's plus `quantization_config` {quant_method "fp8", fmt "e4m3", activation_scheme
  "dynamic", weight_block_size, modules_to_not_convert: lm_head and the routers}; tokenizer and generation files
  copied.

The source must hold plain weights (F32 / F16 / BF16) with its experts per expert (the hub's layout, make-model's
default). Streaming: one tensor at a time, written in shards (checkpoint/index.py write_sharded) into OUT.partial,
renamed at the end.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.index import CONFIG, CheckpointIndex, write_sharded
from ..errors import ConfigError
from ..models import model_args
from ..models.weights import resident_refs
from ..plan import open_index
from ..quant.fp8 import SCALE_DTYPES, quantize_fp8
from ..quant.tensor import read_tensor
from ..store.layout import moe_prefix

BLOCK = (128, 128)  # the hub's weight_block_size
#: resident roles (models/weights.py) stored in FP8: the projections the hub's FP8 uploads quantize
FP8_ROLES = frozenset({"q", "k", "v", "o", "mlp.gate", "mlp.up", "mlp.down", "shared.gate", "shared.up", "shared.down",
                       "mla.q", "mla.q_a", "mla.q_b", "mla.kv_a", "mla.kv_b", "delta.qkv", "delta.z", "delta.qkvz"})

def fp8_names(index: CheckpointIndex) -> tuple[set[str], list[str]]:
    """(the index names of the weights to store in FP8, the modules left plain that a GPU loader must not convert:
    lm_head and the routers). ConfigError for a source sluice cannot export (quantized, or experts not per expert)."""
    src = index.folder / CONFIG
    if index.config.get("quantization_config") is not None or any(r.quantized for r in index.tensors.values()):
        raise ConfigError(f"{src}: the model is quantized already (quantization_config or quantized tensors); "
                          "export FP8 from its bf16 / float32 Hugging Face folder")
    arch, args = model_args(index.config, src)
    if arch.expert_layer is not None:
        raise ConfigError(f"{src}: {index.config.get('model_type')} ships its experts in its own format (gpt-oss: "
                          "MXFP4); sluice writes FP8 folders of the gate / up / down expert families")
    spec = args.spec()
    refs = resident_refs(index, spec, arch)
    names = {ref.name for role, ref in refs.items() if role.split(".", 2)[-1] in FP8_ROLES}
    keep = ["lm_head"] + [ref.name.removesuffix(".weight") for role, ref in refs.items()
                          if role.split(".", 2)[-1] in ("router", "shared_gate")]
    for L, sparse in enumerate(spec.moe_layers):
        if not sparse:
            continue
        p = moe_prefix(index, arch, L)
        if f"{p}.experts.gate_up_proj" in index or f"{p}.experts.gate_proj" in index:
            raise ConfigError(f"{src}: layer {L}'s experts are stacked in one tensor; sluice writes FP8 experts per "
                              "expert as the hub's uploads have them: export from a per-expert folder (the default "
                              "of save_pretrained and sluice make-model)")
        names |= {index[f"{p}.experts.{e}.{proj}.weight"].name
                  for e in range(spec.num_experts) for proj in arch.EXPERT_PROJ}
    return {n for n, r in index.tensors.items() if r.name in names}, keep


def fp8_stream(index: CheckpointIndex, quantized: set[str], block: tuple[int, int] = BLOCK,
               scale_dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """(file name, tensor) of every tensor of the output, in the source's order: the `quantized` ones as their e4m3
    codes and `weight_scale_inv`, the others as stored."""
    for name, ref in index.tensors.items():
        t = read_tensor(ref)
        if name in quantized:
            codes, scale = quantize_fp8(t, block, scale_dtype)
            yield ref.name, codes
            yield ref.name + "_scale_inv", scale
        else:
            yield ref.name, t
        del t


def planned_bytes(model: str | os.PathLike[str], block: tuple[int, int] = BLOCK) -> int:
    """The bytes export_fp8 writes with float32 scales: for a progress bar."""
    index = open_index(model)
    quantized, _ = fp8_names(index)
    total = 0
    for name, ref in index.tensors.items():
        if name in quantized:
            rows, cols = ref.numel // ref.shape[-1], ref.shape[-1]
            total += ref.numel + 4 * -(-rows // block[0]) * -(-cols // block[1])
        else:
            total += ref.nbytes
    return total


def export_fp8(model: str | os.PathLike[str], out: str | os.PathLike[str], block: tuple[int, int] = BLOCK,
               scale_dtype: torch.dtype = torch.float32, force: bool = False,
               progress: Callable[[int], None] | None = None, max_shard_bytes: int = 2**30) -> dict[str, Any]:
    """Write `model` (a Hugging Face MoE folder of plain weights) as an FP8 folder at `out` (see the module doc):
    blocks of `block` = (rows, inputs) weights, scales in `scale_dtype`. `progress(nbytes)` after each tensor
    written. Returns a summary: path, bytes, tensors, type, quantized (how many weights are FP8), fallbacks (none).
    ConfigError for a source sluice cannot export, OutputExistsError when OUT exists (see `force`)."""
    from .output import Tally, copy_side_files, writing_model

    bn, bk = block
    if type(bn) is not int or type(bk) is not int or bn < 1 or bk < 32 or bk % 32 or scale_dtype not in SCALE_DTYPES:
        raise ConfigError(f"FP8 blocks {list(block)} with {scale_dtype} scales: sluice reads blocks [rows, inputs] "
                          "whose inputs are whole groups of 32, scales in float32 / bfloat16 / float16")
    folder, out = Path(model), Path(out)
    index = open_index(folder)
    quantized, keep = fp8_names(index)
    tensors = Tally(fp8_stream(index, quantized, block, scale_dtype), progress)
    with writing_model(out, force) as partial:
        files = write_sharded(partial, tensors, max_shard_bytes)
        config = json.loads((folder / CONFIG).read_text("utf-8"))  # the source's, as written (a wrapper kept)
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(block), "modules_to_not_convert": keep}
        (partial / CONFIG).write_text(json.dumps(config, indent=2) + "\n", "utf-8")
        copy_side_files(folder, partial)
    size = sum((out / f.name).stat().st_size for f in files)
    return {"path": str(out), "bytes": size, "tensors": tensors.count, "type": "fp8", "quantized": len(quantized),
            "fallbacks": []}
