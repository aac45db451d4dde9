"""Architectures, one module per config.json `model_type`. Each exposes ModelArgs, MOE_PREFIXES, EXPERT_PROJ."""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

from ..errors import ConfigError
from .schema import show

SUPPORTED = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe")


def get_arch(model_type: Any, source: str | os.PathLike[str] = "config.json") -> ModuleType:
    """The module for `model_type`; ConfigError naming `source` and listing the supported ones otherwise."""
    if not isinstance(model_type, str) or model_type not in SUPPORTED:
        raise ConfigError(f"{show(model_type)} is not supported; supported: {', '.join(SUPPORTED)}",
                          file=str(source), field="model_type")
    return importlib.import_module(f"{__name__}.{model_type}")


def model_args(config: dict, source: str | os.PathLike[str] = "config.json") -> tuple[ModuleType, Any]:
    """(architecture module, its validated ModelArgs) for a parsed config.json; `source` is the file's path, named
    in every ConfigError with the field at fault and the accepted values."""
    arch = get_arch(config.get("model_type") if isinstance(config, dict) else None, source)
    return arch, arch.ModelArgs.from_dict(config, source=source)
