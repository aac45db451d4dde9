"""The checkpoint opener: picks the index class for a path (the classes never test for each other's files).

    index = open_index("model-Q4_K_M.gguf", gguf_archs)   # a .gguf file (or the first of a split set): GGUFIndex
    index = open_index("Qwen3-30B-A3B/", gguf_archs)      # a folder: CheckpointIndex (Hugging Face or MLX layout)

`gguf_archs` (general.architecture -> gguf_arch.GGUFArch) is the architectures' table of how llama.cpp stores them,
`mlx_values` (model_type -> tensor name or suffix -> ref.STORED key) what mlx-lm's converter does to their values;
the layers above pass models.gguf_archs() and models.mlx_values() (plan.open_index does).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from .gguf_arch import GGUFArchs
from .gguf_index import GGUFIndex
from .index import CheckpointIndex


def open_index(path: str | os.PathLike[str], gguf_archs: GGUFArchs,
               mlx_values: Mapping[str, Mapping[str, str]] | None = None) -> CheckpointIndex:
    """The index of the model at `path`: a GGUFIndex for a .gguf file, else the folder's CheckpointIndex. Raises
    CheckpointError / ConfigError naming the file and what is wrong with it."""
    path = Path(path)
    if path.suffix == ".gguf" and not path.is_dir():
        return GGUFIndex.open(path, gguf_archs)
    return CheckpointIndex.open(path, mlx_values)
