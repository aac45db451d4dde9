"""Where the bytes are: config.json plus safetensors headers, or a GGUF file's metadata and tensor infos ->
TensorRef(path, offset, nbytes, dtype, shape); an MLX or FP8 folder's quantized weights carry their scales
(mlx_index.py, fp8_index.py)."""

from sluice.checkpoint.gguf import read_gguf
from sluice.checkpoint.gguf_index import GGUFIndex
from sluice.checkpoint.index import CheckpointIndex, write_sharded
from sluice.checkpoint.ref import DTYPES, TensorRef
from sluice.checkpoint.safetensors import read_header, write_safetensors

__all__ = ["CheckpointIndex", "DTYPES", "GGUFIndex", "TensorRef", "read_gguf", "read_header", "write_safetensors",
           "write_sharded"]
