"""read_bytes: a resident load of one whole tensor's stored bytes with a plain buffered read (no mapping, no pool);
quant/tensor.py read_tensor turns them into a tensor of the compute dtype."""

from __future__ import annotations

import torch

from sluice.checkpoint.ref import TensorRef
from sluice.errors import CheckpointError


def read_bytes(ref: TensorRef) -> torch.Tensor:
    """`ref`'s bytes as stored: uint8 [nbytes] (CheckpointError as read_tensor)."""
    raw = torch.empty(ref.nbytes, dtype=torch.uint8)  # [nbytes], filled in place
    if ref.nbytes:
        view = memoryview(raw.numpy()).cast("B")
        try:
            with open(ref.path, "rb", buffering=0) as f:
                if ref.stamp is not None:
                    ref.stamp.check(f.fileno(), ref.name)
                f.seek(ref.offset)
                done = 0
                while done < ref.nbytes:
                    n = f.readinto(view[done:])
                    if not n:
                        raise CheckpointError(
                            f"file ends inside the tensor: read {done} of {ref.nbytes} bytes at offset {ref.offset}; "
                            "the file is truncated, re-download it",
                            file=ref.path,
                            tensor=ref.name,
                        )
                    done += n
        except OSError as e:
            raise CheckpointError(f"cannot read: {e}", file=ref.path, tensor=ref.name) from e
    return raw
