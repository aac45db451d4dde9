"""read_tensor round-trips every dtype byte for byte, including scalars and empty tensors."""

from __future__ import annotations

import pytest
import torch

from sluice.checkpoint.ref import TensorRef, dtype_code
from sluice.errors import CheckpointError
from sluice.quant.tensor import read_tensor


def raw(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


TENSORS = [
    torch.randn(3, 5),
    torch.tensor(3.5, dtype=torch.bfloat16),  # scalar
    torch.empty(0, 4),  # zero-size
    torch.tensor([True, False, True]),
    torch.arange(7, dtype=torch.int64),
    torch.tensor([1, 2], dtype=torch.uint32),
    torch.randn(2, 3).to(torch.float8_e4m3fn),
    torch.randn(4, 1, 2).half(),
]


def test_round_trip(tmp_path):
    path = tmp_path / "t.bin"
    blob, refs = b"hdr", []
    for i, t in enumerate(TENSORS):
        refs.append(TensorRef(f"t{i}", str(path), len(blob), len(raw(t)), dtype_code(t.dtype), tuple(t.shape)))
        blob += raw(t)
    path.write_bytes(blob)
    for t, ref in zip(TENSORS, refs):
        got = read_tensor(ref)
        assert got.dtype == t.dtype and got.shape == t.shape and raw(got) == raw(t)


def test_truncated_and_missing(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(b"\0" * 10)
    with pytest.raises(CheckpointError, match="truncated") as e:
        read_tensor(TensorRef("w", str(path), 4, 8, "F32", (2,)))
    assert e.value.file == str(path) and e.value.tensor == "w"
    with pytest.raises(CheckpointError):
        read_tensor(TensorRef("w", str(tmp_path / "nope"), 0, 4, "F32", (1,)))
    with pytest.raises(CheckpointError, match="nbytes"):
        read_tensor(TensorRef("w", str(path), 0, 4, "F32", (2,)))


def test_stamped_ref_refuses_a_changed_file(tmp_path):
    """A ref from read_header carries its file's version: a file rewritten or replaced since is refused, naming
    the file and the tensor, instead of read as if the header still described it."""
    from sluice.checkpoint import read_header, write_safetensors

    path = write_safetensors(tmp_path / "m.safetensors", {"w": torch.arange(4, dtype=torch.float32)})
    ref = read_header(path)[0]["w"]
    assert torch.equal(read_tensor(ref), torch.arange(4, dtype=torch.float32))
    write_safetensors(path, {"w": torch.zeros(4)})  # same layout, new bytes, renamed over the old file
    with pytest.raises(CheckpointError, match="replaced by another file") as e:
        read_tensor(ref)
    assert e.value.file == str(path) and e.value.tensor == "w"
