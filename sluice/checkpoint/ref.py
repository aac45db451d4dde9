"""TensorRef: where one tensor's bytes are. The unit the I/O layer reads."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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
class TensorRef:
    """One tensor inside a safetensors file: absolute byte `offset` in `path`, `nbytes`, dtype code, shape."""

    name: str
    path: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][1]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)
