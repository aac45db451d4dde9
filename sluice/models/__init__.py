"""Architectures, one module per config.json `model_type`. Each exposes ModelArgs, MOE_PREFIXES, EXPERT_PROJ."""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import ConfigError

SUPPORTED = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe")


def get_arch(model_type: str | None) -> ModuleType:
    """The module for `model_type`; ConfigError listing the supported ones otherwise."""
    if model_type not in SUPPORTED:
        raise ConfigError(
            f"config.json: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    return importlib.import_module(f"{__name__}.{model_type}")
