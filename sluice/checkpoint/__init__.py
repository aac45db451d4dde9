"""Where the bytes are: config.json plus safetensors headers -> TensorRef(path, offset, nbytes, dtype, shape)."""

from sluice.checkpoint.index import CheckpointIndex, write_sharded
from sluice.checkpoint.ref import DTYPES, TensorRef
from sluice.checkpoint.safetensors import read_header, write_safetensors

__all__ = ["CheckpointIndex", "DTYPES", "TensorRef", "read_header", "write_safetensors", "write_sharded"]
