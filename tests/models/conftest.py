"""Fixtures the model tests share."""

from __future__ import annotations

import pytest
import torch

from .tiny import hf_model, write_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(arch, dtype, layout) -> (folder, transformers model), built lazily and shared by the module."""
    cache: dict = {}

    def get(arch: str, dtype: torch.dtype = torch.float32, layout: str = "per_expert"):
        key = (arch, dtype, layout)
        if key not in cache:
            model = hf_model(arch, dtype)
            folder = tmp_path_factory.mktemp(f"{arch}-{str(dtype)[6:]}-{layout}")
            cache[key] = (write_checkpoint(model, folder, layout), model)
        return cache[key]

    return get
