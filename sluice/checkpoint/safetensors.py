"""safetensors headers, read and written without the `safetensors` package.

The format: an 8-byte little-endian header length N, N bytes of UTF-8 JSON (an object, so it starts with `{`; the
writer pads it with spaces to a multiple of 8), then the data. Each JSON entry is
`name: {"dtype": code, "shape": [...], "data_offsets": [begin, end]}` with offsets relative to the data start;
an optional `"__metadata__"` entry maps str -> str. As in the Rust reference (`Metadata::validate` and the check
after it), the tensors, sorted by offsets, cover the data section exactly: the first begins at 0, each begins
where the previous ended, and the last ends at the end of the file. That is what makes a wrong header length
visible: a length cut into the header's padding parses as the same JSON, but shifts every tensor and leaves bytes
over at the end. Everything is validated at open time so that a bad file fails here, naming the file and tensor,
instead of as garbage weights or a fault deep inside a decode step.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from sluice.checkpoint.jsonfile import check_value, loads, open_regular
from sluice.checkpoint.ref import DTYPES, FileStamp, TensorRef, dtype_code
from sluice.errors import CheckpointError

# The Rust reference refuses headers over 100 MB (MAX_HEADER_SIZE = 100_000_000); a bigger one means a corrupt
# length field.
MAX_HEADER_BYTES = 100_000_000
# torch sizes, strides and byte counts are int64: a shape whose nonzero dimensions times the element size exceed this
# cannot be a tensor, even an empty one (a zero-element [0, 2**63] passes the reference's check, then fails in torch).
MAX_TENSOR_BYTES = 2**63 - 1
METADATA_KEY = "__metadata__"
_ENTRY_KEYS = ("dtype", "shape", "data_offsets")
_REDOWNLOAD = "re-download the file (or re-export it)"


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, TensorRef], dict[str, str]]:
    """Parse and validate the header of the safetensors file at `path`.

    Returns `(tensors, metadata)`: tensor name -> TensorRef with ABSOLUTE byte offsets into the file (in header
    order, each carrying the file's FileStamp), and the `__metadata__` dict ({} when absent). Raises
    CheckpointError naming the file (and the tensor) for a short or truncated file, a bad header length, a header
    that is not a JSON object, malformed entries, unknown dtypes, absurd shapes, a byte count that does not match
    dtype x shape, and tensors that do not cover the data section exactly (gaps, overlaps, bytes left over).
    """
    path = Path(path)
    file = str(path)
    try:
        with open_regular(path) as f:
            st = os.fstat(f.fileno())
            size = st.st_size
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
    stamp = FileStamp.of(file, st)

    tensors: dict[str, TensorRef] = {}
    spans: list[tuple[int, int, str]] = []  # (begin, end, name), relative to data_start
    for name, entry in header.items():
        begin, end, ref = _parse_entry(name, entry, file, data_start, stamp)
        tensors[name] = ref
        spans.append((begin, end, name))

    _check_coverage(spans, data_start, size, file)
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


def _parse_json(raw: bytes, file: str) -> dict[str, object]:
    # walk=False: nesting can only hide in entries' extra keys, checked in _parse_entry (walking ~20k entries would
    # cost as much as parsing them).
    header = loads(raw, file, what="header ", unique_keys=True, reference=True, walk=False)
    if not isinstance(header, dict):
        raise CheckpointError(
            f"header is a JSON {type(header).__name__}, expected an object; {_REDOWNLOAD}", file=file
        )
    if raw[:1] != b"{":  # the format requires it (the reference's InvalidHeaderStart); only whitespace gets here
        raise CheckpointError(
            f"header does not start with '{{' (it starts with {raw[:8]!r}); not a safetensors file, or the header "
            f"length is wrong: {_REDOWNLOAD}",
            file=file,
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


def _parse_entry(
    name: str, entry: object, file: str, data_start: int, stamp: FileStamp
) -> tuple[int, int, TensorRef]:
    if not isinstance(entry, dict):
        raise CheckpointError(f"entry is a JSON {type(entry).__name__}, expected an object; {_REDOWNLOAD}",
                              file=file, tensor=name)
    missing = [k for k in _ENTRY_KEYS if k not in entry]
    if missing:
        raise CheckpointError(f"entry lacks {', '.join(missing)}; {_REDOWNLOAD}", file=file, tensor=name)
    if len(entry) > len(_ENTRY_KEYS):  # extra keys are ignored, as by the reference, but not unbounded nesting
        for key, value in entry.items():
            if key not in _ENTRY_KEYS:
                check_value(value, file, what=f"header entry {name!r} ", depth=3)
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise CheckpointError(f"dtype {dtype!r} is not a string; {_REDOWNLOAD}", file=file, tensor=name)
    if dtype not in DTYPES:
        raise CheckpointError(
            f"unknown dtype {dtype[:40]!r}; known dtypes: {', '.join(sorted(DTYPES))}. "
            "Convert the tensor to one of these, or the file is corrupt",
            file=file, tensor=name,
        )
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise CheckpointError(f"shape {_short(shape)} is not a list of integers; {_REDOWNLOAD}",
                              file=file, tensor=name)
    if any(d < 0 for d in shape):
        raise CheckpointError(f"shape {_short(shape)} has a negative dimension; {_REDOWNLOAD}",
                              file=file, tensor=name)
    itemsize = DTYPES[dtype][0]
    _check_shape_bounds(shape, itemsize, dtype, file, name)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise CheckpointError(f"data_offsets {_short(offsets)} is not [begin, end] integers; {_REDOWNLOAD}",
                              file=file, tensor=name)
    begin, end = offsets
    if begin < 0 or begin > end:
        raise CheckpointError(f"data_offsets [{begin}, {end}] is not a valid range (need 0 <= begin <= end); "
                              f"{_REDOWNLOAD}", file=file, tensor=name)
    expected = itemsize * (0 if 0 in shape else _product(shape))
    if end - begin != expected:
        raise CheckpointError(
            f"holds {end - begin} bytes but {dtype} {shape} needs {expected}; {_REDOWNLOAD}",
            file=file, tensor=name,
        )
    ref = TensorRef(name, file, data_start + begin, end - begin, dtype, tuple(shape), stamp=stamp)
    return begin, end, ref


def _product(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _check_shape_bounds(shape: list[int], itemsize: int, dtype: str, file: str, name: str) -> None:
    """Refuse a shape whose nonzero dimensions times the element size exceed int64 (early exit: a hostile shape of
    a million huge dimensions costs a few multiplications, not a million-digit product)."""
    total = itemsize
    for d in shape:
        if d:
            total *= d
            if total > MAX_TENSOR_BYTES:
                raise CheckpointError(
                    f"shape {_short(shape)} is too large for any tensor: its nonzero dimensions times the {dtype} "
                    f"element size exceed 2**63 - 1 bytes (torch sizes are int64); {_REDOWNLOAD}",
                    file=file, tensor=name,
                )


def _short(value: object) -> str:
    """repr of a header value, cut to 80 characters (a hostile header can hold megabytes in one field)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_coverage(spans: list[tuple[int, int, str]], data_start: int, size: int, file: str) -> None:
    """The tensors, sorted by (begin, end), must tile the data section [data_start, size) exactly, as the
    reference requires.

    Checked in the order that names the likeliest cause: data past the end of the file (a truncated download)
    first, then overlaps and gaps (a corrupt header), then bytes left over after the last tensor (a wrong header
    length, e.g. one cut into the header's padding, which shifts every tensor).
    """
    data_size = size - data_start
    if spans:
        _, end, name = max(spans, key=lambda s: s[1])
        if end > data_size:
            raise CheckpointError(
                f"data ends at byte {data_start + end} but the file has {size} bytes: truncated, "
                f"{end - data_size} bytes missing; {_REDOWNLOAD}",
                file=file, tensor=name,
            )
    pos, prev, prev_begin = 0, None, 0
    for begin, end, name in sorted(spans):
        if begin < pos:
            raise CheckpointError(
                f"data_offsets [{begin}, {end}] overlap tensor {prev!r} at [{prev_begin}, {pos}]; {_REDOWNLOAD}",
                file=file, tensor=name,
            )
        if begin > pos:
            after = f"after tensor {prev!r}" if prev is not None else "at the start of the data section"
            raise CheckpointError(
                f"begins at byte {begin} of the data section, leaving bytes [{pos}, {begin}) {after} unused (the "
                f"tensors must cover the data section without gaps); {_REDOWNLOAD}",
                file=file, tensor=name,
            )
        pos, prev, prev_begin = end, name, begin
    if pos != data_size:
        what = f"the last tensor ({prev!r}) ends at byte {data_start + pos}" if prev is not None else (
            f"the header lists no tensors and ends at byte {data_start}")
        raise CheckpointError(
            f"{data_size - pos} bytes are left over at the end of the file ({what}, the file has {size} bytes): "
            f"the header length or the data offsets are wrong, which would shift every tensor; {_REDOWNLOAD}",
            file=file,
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
