"""safetensors headers, read and written without the `safetensors` package.

The format: an 8-byte little-endian header length N, N bytes of UTF-8 JSON, then the data. Each JSON entry is
`name: {"dtype": code, "shape": [...], "data_offsets": [begin, end]}` with offsets relative to the data start;
an optional `"__metadata__"` entry maps str -> str. Everything is validated at open time so that a bad file fails
here, naming the file and tensor, instead of as garbage weights or a fault deep inside a decode step.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from sluice.checkpoint.ref import DTYPES, TensorRef, dtype_code
from sluice.errors import CheckpointError

# The Rust reference implementation refuses headers over 100 MB; a bigger one means a corrupt length field.
MAX_HEADER_BYTES = 100 * 1024 * 1024
METADATA_KEY = "__metadata__"
_REDOWNLOAD = "re-download the file (or re-export it)"


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, TensorRef], dict[str, str]]:
    """Parse and validate the header of the safetensors file at `path`.

    Returns `(tensors, metadata)`: tensor name -> TensorRef with ABSOLUTE byte offsets into the file (in header
    order), and the `__metadata__` dict ({} when absent). Raises CheckpointError naming the file (and the tensor)
    for a short or truncated file, a bad header length, bad JSON, malformed entries, unknown dtypes, a byte count
    that does not match dtype x shape, and overlapping tensors.
    """
    path = Path(path)
    file = str(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(
                    f"file is {size} bytes, shorter than the 8-byte safetensors header length; {_REDOWNLOAD}",
                    file=file,
                )
            (n,) = struct.unpack("<Q", prefix)
            _check_header_length(n, size, file)
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror or e}", file=file) from e
    if len(raw) < n:  # the file shrank between fstat and read
        raise CheckpointError(f"header cut short ({len(raw)} of {n} bytes); {_REDOWNLOAD}", file=file)

    header = _parse_json(raw, file)
    data_start = 8 + n
    metadata = _parse_metadata(header.pop(METADATA_KEY, None), file)

    tensors: dict[str, TensorRef] = {}
    spans: list[tuple[int, int, str]] = []  # (begin, end, name), relative to data_start
    for name, entry in header.items():
        begin, end, ref = _parse_entry(name, entry, path, data_start)
        tensors[name] = ref
        spans.append((begin, end, name))

    _check_in_file(spans, data_start, size, file)
    _check_no_overlap(spans, file)
    return tensors, metadata


def _check_header_length(n: int, size: int, file: str) -> None:
    if n == 0:
        raise CheckpointError(f"header length is 0; not a safetensors file, or {_REDOWNLOAD}", file=file)
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"header length {n} bytes exceeds the {MAX_HEADER_BYTES} byte limit; "
            f"not a safetensors file, or {_REDOWNLOAD}",
            file=file,
        )
    if 8 + n > size:
        raise CheckpointError(
            f"header length {n} runs past the end of the {size}-byte file "
            f"({8 + n - size} bytes missing); the file is truncated or not safetensors: {_REDOWNLOAD}",
            file=file,
        )


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    # json.loads would silently keep the last of two equal keys; two tensors with one name is a broken file.
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _parse_json(raw: bytes, file: str) -> dict[str, object]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"header is not valid UTF-8 (byte {e.start}); {_REDOWNLOAD}", file=file) from e
    try:
        header = json.loads(text, object_pairs_hook=_reject_duplicates)
    except _DuplicateKey as e:
        raise CheckpointError(f"header lists the name twice; {_REDOWNLOAD}", file=file, tensor=e.key) from e
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"header is not valid JSON ({e.msg} at char {e.pos}); {_REDOWNLOAD}", file=file
        ) from e
    if not isinstance(header, dict):
        raise CheckpointError(
            f"header is a JSON {type(header).__name__}, expected an object; {_REDOWNLOAD}", file=file
        )
    return header


def _parse_metadata(meta: object, file: str) -> dict[str, str]:
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(
            f"{METADATA_KEY} must be an object of string -> string; {_REDOWNLOAD}", file=file
        )
    return meta


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true would otherwise pass as 1


def _parse_entry(name: str, entry: object, path: Path, data_start: int) -> tuple[int, int, TensorRef]:
    file = str(path)
    if not isinstance(entry, dict):
        raise CheckpointError(f"entry is a JSON {type(entry).__name__}, expected an object; {_REDOWNLOAD}",
                              file=file, tensor=name)
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise CheckpointError(f"entry lacks {', '.join(missing)}; {_REDOWNLOAD}", file=file, tensor=name)
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise CheckpointError(f"dtype {dtype!r} is not a string; {_REDOWNLOAD}", file=file, tensor=name)
    if dtype not in DTYPES:
        raise CheckpointError(
            f"unknown dtype {dtype!r}; known dtypes: {', '.join(sorted(DTYPES))}. "
            "Convert the tensor to one of these, or the file is corrupt",
            file=file, tensor=name,
        )
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise CheckpointError(f"shape {shape!r} is not a list of integers; {_REDOWNLOAD}", file=file, tensor=name)
    if any(d < 0 for d in shape):
        raise CheckpointError(f"shape {shape} has a negative dimension; {_REDOWNLOAD}", file=file, tensor=name)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise CheckpointError(f"data_offsets {offsets!r} is not [begin, end] integers; {_REDOWNLOAD}",
                              file=file, tensor=name)
    begin, end = offsets
    if begin < 0 or begin > end:
        raise CheckpointError(f"data_offsets [{begin}, {end}] is not a valid range (need 0 <= begin <= end); "
                              f"{_REDOWNLOAD}", file=file, tensor=name)
    itemsize = DTYPES[dtype][0]
    expected = math.prod(shape) * itemsize
    if end - begin != expected:
        raise CheckpointError(
            f"holds {end - begin} bytes but {dtype} {shape} needs {expected}; {_REDOWNLOAD}",
            file=file, tensor=name,
        )
    ref = TensorRef(name, file, data_start + begin, end - begin, dtype, tuple(shape))
    return begin, end, ref


def _check_in_file(spans: list[tuple[int, int, str]], data_start: int, size: int, file: str) -> None:
    if not spans:
        return
    begin, end, name = max(spans, key=lambda s: s[1])
    if data_start + end > size:
        raise CheckpointError(
            f"data ends at byte {data_start + end} but the file has {size} bytes: truncated, "
            f"{data_start + end - size} bytes missing; {_REDOWNLOAD}",
            file=file, tensor=name,
        )


def _check_no_overlap(spans: list[tuple[int, int, str]], file: str) -> None:
    # Sort once: O(n log n) for headers with thousands of tensors. Empty tensors occupy no bytes, so skip them.
    live = sorted(s for s in spans if s[1] > s[0])
    for (b0, e0, n0), (b1, e1, n1) in zip(live, live[1:]):
        if b1 < e0:
            raise CheckpointError(
                f"bytes [{b1}, {e1}) overlap tensor {n0!r} at [{b0}, {e0}); {_REDOWNLOAD}",
                file=file, tensor=n1,
            )


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    *,
    on_written: Callable[[int], None] | None = None,
) -> Path:
    """Write `tensors` (in the given order, packed back to back) to a safetensors file at `path`.

    The result loads with `safetensors.torch.load_file`. Writes `path` under a temporary name and renames it at
    the end, so an error never leaves a half-written file. `on_written(nbytes)` is called after each tensor (a
    progress hook). Returns the path.
    """
    path = Path(path)
    if sys.byteorder != "little":  # TODO: byteswap on big-endian hosts; none are targeted today.
        raise NotImplementedError("writing safetensors needs a little-endian host")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("safetensors metadata must map str -> str")

    header: dict[str, object] = {}
    if metadata:
        header[METADATA_KEY] = dict(metadata)
    blobs: list[torch.Tensor] = []
    offset = 0
    for name, t in tensors.items():
        if name == METADATA_KEY:
            raise ValueError(f"{METADATA_KEY!r} is reserved and cannot name a tensor")
        try:
            code = dtype_code(t.dtype)
        except ValueError:
            raise CheckpointError(
                f"dtype {t.dtype} has no safetensors code; supported: {', '.join(sorted(DTYPES))}",
                file=str(path), tensor=name,
            ) from None
        blob = _as_bytes(t)
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + blob.numel()]}
        offset += blob.numel()
        blobs.append(blob)

    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # pad so the data starts 8-byte aligned, as the reference writer does

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for blob in blobs:
                if blob.numel():
                    f.write(memoryview(blob.numpy()))
                if on_written is not None:
                    on_written(blob.numel())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw little-endian bytes as a flat uint8 CPU tensor (no copy when already contiguous on CPU)."""
    t = t.detach().to("cpu").contiguous()
    # reshape(-1) first: .view(uint8) cannot reinterpret a 0-d tensor, and numpy has no bf16/fp8 to export.
    return t.reshape(-1).view(torch.uint8)
