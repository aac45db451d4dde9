"""TensorRef: where one tensor's bytes are. The unit the I/O layer reads."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from sluice.errors import CheckpointError

# safetensors dtype code -> (bytes per element, torch dtype)
DTYPES: dict[str, tuple[int, torch.dtype]] = {
    "F64": (8, torch.float64),
    "F32": (4, torch.float32),
    "F16": (2, torch.float16),
    "BF16": (2, torch.bfloat16),
    "I64": (8, torch.int64),
    "I32": (4, torch.int32),
    "I16": (2, torch.int16),
    "I8": (1, torch.int8),
    "U8": (1, torch.uint8),
    "U32": (4, torch.uint32),
    "BOOL": (1, torch.bool),
    "F8_E4M3": (1, torch.float8_e4m3fn),
    "F8_E5M2": (1, torch.float8_e5m2),
}


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors code of a torch dtype (inverse of DTYPES)."""
    for code, (_, dt) in DTYPES.items():
        if dt == dtype:
            return code
    raise ValueError(f"no safetensors dtype for {dtype}")


@dataclass(frozen=True)
class FileStamp:
    """Which version of a file a header described: `path` plus device, inode, size and mtime (ns) from fstat.

    Readers compare a file's fstat with its stamp when they open it and before each batch they read from it, so a
    file replaced, truncated, extended or rewritten after its header was read ends in a CheckpointError naming it
    instead of shifted bytes or a SIGBUS. `check` costs one fstat.
    """

    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str, st: os.stat_result) -> FileStamp:
        """The stamp of `path` from an fstat/stat result."""
        return cls(path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def check(self, fd: int, tensor: str | None = None) -> None:
        """CheckpointError naming the file (and `tensor`) when the open file `fd` is not this version any more."""
        try:
            st = os.fstat(fd)
        except OSError as e:
            raise CheckpointError(f"cannot stat: {e.strerror or e}", file=self.path, tensor=tensor) from e
        self.compare(st, tensor)

    def compare(self, st: os.stat_result, tensor: str | None = None) -> None:
        """CheckpointError naming the file (and `tensor`) when `st`, an fstat of it, shows another file or version."""
        if (st.st_dev, st.st_ino) != (self.dev, self.ino):
            raise CheckpointError(
                "was replaced by another file after its header was read; reload the model to use the new file",
                file=self.path, tensor=tensor,
            )
        if st.st_size != self.size:
            how = "truncated" if st.st_size < self.size else "extended"
            raise CheckpointError(
                f"changed on disk after its header was read: {how} from {self.size} to {st.st_size} bytes "
                "(overwritten or re-downloaded in place?); reload the model once the file is complete",
                file=self.path, tensor=tensor,
            )
        if st.st_mtime_ns != self.mtime_ns:
            raise CheckpointError(
                "changed on disk after its header was read: rewritten in place (same size, new modification "
                "time), so its bytes may no longer be the ones the header describes; reload the model",
                file=self.path, tensor=tensor,
            )


@dataclass(frozen=True)
class TensorRef:
    """One tensor inside a safetensors file: absolute byte `offset` in `path`, `nbytes`, dtype code, shape.

    `stamp`: the version of the file the header was read from (None when the ref was made by hand); readers
    refuse to read the tensor from any other version (see FileStamp). Not part of equality.
    """

    name: str
    path: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    stamp: FileStamp | None = field(default=None, compare=False, repr=False)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][1]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)
