"""read_tensor: a resident load of one whole tensor with a plain buffered read (no mapping, no pool)."""

from __future__ import annotations

import torch

from sluice.checkpoint.ref import TensorRef
from sluice.errors import CheckpointError


def read_tensor(ref: TensorRef) -> torch.Tensor:
    """Read `ref`'s bytes into a fresh tensor of `ref.torch_dtype` and `ref.shape` (scalars and empty tensors too).

    Rows a GGUF converter permuted for llama.cpp's rope (`ref.rope_heads`) come back in Hugging Face order. Raises
    CheckpointError (naming the file and tensor) when the file is missing, short, not the version its header was
    read from (`ref.stamp`), the byte count does not match the dtype and shape, or the tensor is in a block format
    (read its raw bytes and dequantize those instead).
    """
    expected = ref.numel * ref.itemsize
    if ref.nbytes != expected:
        raise CheckpointError(
            f"nbytes {ref.nbytes} != {expected} for dtype {ref.dtype} shape {list(ref.shape)}",
            file=ref.path,
            tensor=ref.name,
        )
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
    out = raw.view(ref.torch_dtype).reshape(ref.shape)
    order = ref.row_order()
    return out if order is None else out[order]
