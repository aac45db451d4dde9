"""Architectures, one module per config.json `model_type`, each composing its layers from models/layers/.

How to add an architecture: copy the closest module (say qwen3_moe.py) to `models/<model_type>.py`, change what
differs, and add its tests (a TINY config in tests/models/tiny.py runs it through parity, GGUF and synth tests).
Nothing else needs editing: every module of this package that sets `MODEL_TYPE` is an architecture, and generic code
reads all it needs from the module. What a module provides (tests/models/test_arch.py checks it for every one):

    MODEL_TYPE        config.json `model_type` this module runs, e.g. "qwen3_moe"
    ModelArgs         a BaseArgs dataclass (args.py): each config.json field the math reads, declared with `cfg(...)`
                      (type, range, aliases such as num_local_experts, validated by schema.py); `spec()` -> Spec;
                      `moe_layers()` says which layers are sparse (dense layers: mlp_only_layers,
                      first_k_dense_replace, ...)
    MOE_PREFIXES      the MoE block's names under `model.layers.N.`, the hub's per-expert layout's first
                      (Mixtral: ("block_sparse_moe", "mlp")); store/layout.py finds the router `{prefix}.gate.weight`
    EXPERT_PROJ       the per-expert projection names (gate, up, down), e.g. ("w1", "w3", "w2")
    INTERMEDIATE_KEY  the config.json key of one routed expert's intermediate size (tools/inflate.py scales it)
    layer_tensors     (spec, layer, moe_prefix) -> [TensorName]: one layer's resident tensors (roles, checkpoint names,
                      shapes); most modules use arch.layer_tensors, the Qwen/Mixtral/OLMoE layout; models/weights.py
                      loads them and tools/synth.py writes them
    SYNTH             SynthDefaults (arch.py): transformers class, the family's expert count / top-k / rope theta / eps
    synth_config      (SynthConfig) -> dict: the config.json keys of a synthetic checkpoint beyond the common ones
                      (tools/synth.py); raises ConfigError for a shape the architecture cannot have
    GGUF              GGUFArch (checkpoint/gguf_arch.py) -- llama.cpp's architecture name, tensor names, defaults
                      and metadata -> config hook -- or None when llama.cpp has no such architecture (then a GGUF file
                      never maps to it: `by_gguf_name` returns None)
    layers            (layers.Build) -> [layer]: the model's decoder layers, composed from the modules of
                      models/layers/ (a residual rule holding a mixer and a feed-forward block), e.g. qwen3_moe's
                      PreNorm(Attention, MoE or dense)

    ROUTER            the router's name under the MoE prefix ("gate"; gpt_oss: "router")
    MLX_MOE           mlx-lm's name of the MoE block in its folders ("mlp"; Mixtral: "block_sparse_moe")
    MLX_VALUES        {tensor name or suffix: ref.STORED key}: the values mlx-lm's converter changes (the hybrids'
                      zero-centred norms stored as 1 + w, checkpoint/mlx_index.py); {} for most
    synth_experts     None, or (SynthConfig, draw, generator, prefix) -> (name, tensor) of one layer's experts:
                      tools/synth.py writes these instead of its per-expert / fused layouts (gpt_oss: MXFP4 as shipped)
    synth_expert_nbytes  None, or (SynthConfig) -> bytes of one expert as synth_experts writes it
    expert_layer      None, or (store.layout.ExpertLayout, index, MoE prefix, layer) -> its kind: where the layer's
                      experts are when the architecture stores them its own way (gpt_oss: biased MXFP4 experts);
                      None: the per-expert, fused and stacked layouts store/layout.py knows
    synth_wrap        None, or (SynthConfig, Spec, the text model's config.json) -> arch.SynthWrap: what a synthetic
                      checkpoint holds around the text model as the family ships it (qwen3_5_moe: the hub's
                      multimodal wrapper and vision tower; the hybrids' multi-token-prediction head)

Optional (generic code uses arch.py's default where a module has none; `check_arch` tests it when present):

    final_tensors     (Spec) -> [TensorName]: the resident tensors after the last layer (default: model.norm.weight,
                      role "norm"; qwen4_exp: its hyper-connections' final mixer, roles "hc_mixer.*")

A module outside the package (a plugin, or a test's throwaway architecture) joins with `register(module)`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import pkgutil
from types import ModuleType
from typing import Any

from ..errors import ConfigError
from .schema import show

#: every name an architecture module must define (documented above; `check_arch` tests them)
INTERFACE = ("MODEL_TYPE", "ModelArgs", "MOE_PREFIXES", "EXPERT_PROJ", "INTERMEDIATE_KEY", "layer_tensors", "SYNTH",
             "synth_config", "GGUF", "layers", "ROUTER", "MLX_MOE", "MLX_VALUES", "synth_experts",
             "synth_expert_nbytes", "expert_layer", "synth_wrap")

_registered: dict[str, ModuleType] = {}


@functools.cache
def _builtin() -> dict[str, ModuleType]:
    """The architecture modules of this package (those that set MODEL_TYPE), by model_type, sorted by name."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "MODEL_TYPE"):
            found[module.MODEL_TYPE] = module
    return dict(sorted(found.items()))


def archs() -> dict[str, ModuleType]:
    """Every architecture sluice runs: model_type -> module (the package's, then registered ones)."""
    return {**_builtin(), **_registered}


def supported() -> tuple[str, ...]:
    """The model_types sluice runs (argparse choices, error messages)."""
    return tuple(archs())


def register(module: ModuleType) -> None:
    """Add an architecture module defined outside this package; its interface is checked first (ConfigError)."""
    check_arch(module)
    if module.MODEL_TYPE in archs():
        raise ConfigError(f"model_type {module.MODEL_TYPE!r} is already registered ({archs()[module.MODEL_TYPE]})")
    _registered[module.MODEL_TYPE] = module


def unregister(model_type: str) -> None:
    """Remove an architecture `register` added (package modules stay)."""
    _registered.pop(model_type, None)


def check_arch(module: ModuleType) -> None:
    """ConfigError naming the module and what it lacks when it does not provide the interface above."""
    from .arch import GGUFArch, SynthDefaults
    from .args import BaseArgs

    missing = [name for name in INTERFACE if not hasattr(module, name)]
    if missing:
        raise ConfigError(f"architecture module {module.__name__} lacks {', '.join(missing)} (see sluice/models/"
                          "__init__.py: how to add an architecture)")
    wrong = [name for name, ok in (
        ("MODEL_TYPE", isinstance(module.MODEL_TYPE, str)),
        ("ModelArgs", isinstance(module.ModelArgs, type) and issubclass(module.ModelArgs, BaseArgs)),
        ("MOE_PREFIXES", isinstance(module.MOE_PREFIXES, tuple) and len(module.MOE_PREFIXES) >= 1),
        ("EXPERT_PROJ", isinstance(module.EXPERT_PROJ, tuple) and len(module.EXPERT_PROJ) == 3),
        ("INTERMEDIATE_KEY", isinstance(module.INTERMEDIATE_KEY, str)),
        ("layer_tensors", callable(module.layer_tensors)),
        ("SYNTH", isinstance(module.SYNTH, SynthDefaults)),
        ("synth_config", callable(module.synth_config)),
        ("GGUF", module.GGUF is None or isinstance(module.GGUF, GGUFArch)),
        ("layers", callable(module.layers)),
        ("ROUTER", isinstance(module.ROUTER, str)),
        ("MLX_MOE", isinstance(module.MLX_MOE, str)),
        ("MLX_VALUES", isinstance(module.MLX_VALUES, dict)),
        ("synth_experts", module.synth_experts is None or callable(module.synth_experts)),
        ("synth_expert_nbytes", (module.synth_expert_nbytes is None) == (module.synth_experts is None)),
        ("expert_layer", module.expert_layer is None or callable(module.expert_layer)),
        ("synth_wrap", module.synth_wrap is None or callable(module.synth_wrap)),
        ("final_tensors", callable(getattr(module, "final_tensors", len))),
    ) if not ok]
    if wrong:
        raise ConfigError(f"architecture module {module.__name__}: {', '.join(wrong)} not of the documented type "
                          "(see sluice/models/__init__.py: how to add an architecture)")


def by_gguf_name(name: str) -> ModuleType | None:
    """The architecture llama.cpp calls `name` (GGUF general.architecture), or None if sluice has none. Two modules
    may share one GGUFArch object (one model in two checkpoint layouts: qwen3_5_moe, qwen3_5_moe_text): the first
    in model_type order is the one a GGUF file opens as."""
    for module in archs().values():
        if module.GGUF is not None and module.GGUF.name == name:
            return module
    return None


def gguf_archs() -> dict:
    """general.architecture -> GGUFArch (checkpoint/gguf_arch.py) of every architecture llama.cpp stores, each with
    its model_type: the table the checkpoint layer reads GGUF files by (plan.open_index hands it down)."""
    out: dict = {}
    for module in archs().values():
        if module.GGUF is not None and module.GGUF.name not in out:  # the first of a shared GGUFArch (by_gguf_name)
            out[module.GGUF.name] = dataclasses.replace(module.GGUF, model_type=module.MODEL_TYPE)
    return out


def mlx_values() -> dict:
    """model_type -> the values mlx-lm's converter changes (MLX_VALUES) of every architecture that has some: the
    table the checkpoint layer reads MLX folders by (plan.open_index hands it down)."""
    return {t: module.MLX_VALUES for t, module in archs().items() if module.MLX_VALUES}


#: model_types whose config.json names an architecture under another name: Moonshot's Kimi K2 (its architectures
#: DeepseekV3ForCausalLM; its model card has engines without a kimi_k2 entry rename it deepseek_v3)
ALIASES = {"kimi_k2": "deepseek_v3"}


def get_arch(model_type: Any, source: str | os.PathLike[str] = "config.json") -> ModuleType:
    """The module for `model_type` (or the one ALIASES names for it); ConfigError naming `source` and listing the
    supported ones otherwise."""
    known = archs()
    model_type = ALIASES.get(model_type, model_type) if isinstance(model_type, str) else model_type
    if not isinstance(model_type, str) or model_type not in known:
        raise ConfigError(f"{show(model_type)} is not supported; supported: {', '.join(known)}",
                          file=str(source), field="model_type")
    return known[model_type]


def model_args(config: dict, source: str | os.PathLike[str] = "config.json") -> tuple[ModuleType, Any]:
    """(architecture module, its validated ModelArgs) for a parsed config.json; `source` is the file's path, named
    in every ConfigError with the field at fault and the accepted values."""
    arch = get_arch(config.get("model_type") if isinstance(config, dict) else None, source)
    return arch, arch.ModelArgs.from_dict(config, source=source)
