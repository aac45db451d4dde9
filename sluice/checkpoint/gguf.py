"""GGUF headers, read with an explicit offset walk and validated before any tensor byte is touched.

The format (little-endian; versions 2 and 3 read alike, v1 used 32-bit counts):

    "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x  (key: string, value_type u32, value)       string = u64 length + UTF-8 bytes
    tensor_count x  (name: string, n_dims u32, dims u64 x n_dims (innermost first), ggml type u32, offset u64)
    padding to `general.alignment` (u32, a power of two, default 32), then the data section

Values are u8/i8/u16/i16/u32/i32/u64/i64/f32/f64/bool/string or an array (element type u32, count u64, elements;
arrays may nest). What is required of the data section is what llama.cpp's gguf.cpp requires and every writer
(gguf-py's GGUFWriter, llama.cpp's gguf_write, gguf-split) produces: tensors in tensor-info order, each at the aligned
end of the previous one (offset 0 for the first), so the section is covered exactly, with no gaps or overlaps; the
file ends at the end of the last tensor or at its padded end; nothing follows. Each tensor's row (its
innermost dim) is a whole number of blocks of its type, and its type is one sluice computes with (formats.SUPPORTED).

Lengths and counts are checked against the bytes left in the file before anything is allocated, so a corrupt length
is an error, never a multi-gigabyte allocation or a long loop.
"""

from __future__ import annotations

import math
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .formats import BY_ID, SUPPORTED
from .ref import FileStamp, TensorRef

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 64  # GGML_MAX_NAME: llama.cpp refuses names of 64 bytes or more
MAX_KEY = 65535  # the GGUF spec bounds keys to 2^16 - 1 bytes
MAX_NESTING = 8  # arrays of arrays: gguf-py reads them, llama.cpp refuses them; 8 levels bounds the recursion
# Metadata and tensor infos must end within the first 128 MiB. The largest real headers are tens of MB (a 256k-token
# vocabulary with its merges and scores); the bound keeps a corrupt length inside a huge file from becoming a
# gigabyte-sized string or a list of a billion numbers.
MAX_HEADER_BYTES = 128 << 20
_REDOWNLOAD = "re-download the file (or re-convert it)"

# value type id -> (name, struct code, size); STRING (8) and ARRAY (9) are handled apart
_SCALARS: dict[int, tuple[str, str, int]] = {
    0: ("u8", "B", 1), 1: ("i8", "b", 1), 2: ("u16", "H", 2), 3: ("i16", "h", 2), 4: ("u32", "I", 4),
    5: ("i32", "i", 4), 6: ("f32", "f", 4), 7: ("bool", "?", 1), 10: ("u64", "Q", 8), 11: ("i64", "q", 8),
    12: ("f64", "d", 8),
}
STRING, ARRAY = 8, 9
_U64 = struct.Struct("<Q")
INTEGER_TYPES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})


def type_name(vtype: int, sub: int | None = None) -> str:
    """Readable name of a value type: "u32", "str", "arr[str]"."""
    if vtype == ARRAY:
        return f"arr[{type_name(sub) if sub is not None else '?'}]"
    return "str" if vtype == STRING else _SCALARS.get(vtype, (f"type {vtype}",))[0]


@dataclass
class GGUFFile:
    """One parsed GGUF file: metadata (key -> Python value), each key's value type, tensors by GGUF name.

    `types[key]` is the GGUF value type id (ARRAY for arrays, whose element type is `array_types[key]`).
    Tensor offsets are absolute; shapes are torch order (GGUF dims reversed); dtype is the ggml type name.
    """

    path: Path
    version: int
    alignment: int
    data_start: int
    metadata: dict[str, Any]
    types: dict[str, int]
    array_types: dict[str, int] = field(default_factory=dict)
    tensors: dict[str, TensorRef] = field(default_factory=dict)

    def type_of(self, key: str) -> str:
        """The value type of `key` as a name ("u32", "arr[str]")."""
        return type_name(self.types[key], self.array_types.get(key))


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse and validate the GGUF header of the file at `path` (no tensor data is read).

    Raises CheckpointError naming the file (and the tensor or key) for anything the module docstring does not allow:
    a short file, wrong magic, big-endian or unsupported version, a length or count running past the end of the
    file, invalid UTF-8, duplicate keys or tensor names, an unknown value type, a bad `general.alignment`, a bad
    shape, an unknown or unsupported ggml type, a row that is not whole blocks, a misplaced tensor, trailing bytes.
    """
    path = Path(path)
    file = str(path)
    try:
        # non-blocking, and checked before any read: a FIFO or device named .gguf would block or read without end
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError("is not a regular file (a directory, FIFO, socket or device); pass a .gguf "
                                      "file", file=file)
            os.set_blocking(fd, True)
            f = open(fd, "rb", buffering=0)
        except BaseException:
            os.close(fd)
            raise
        with f:
            size = st.st_size
            if size < 24:
                raise CheckpointError(
                    f"file is {size} bytes, shorter than the 24-byte GGUF header; not GGUF, or {_REDOWNLOAD}",
                    file=file,
                )
            return _Parser(f, size, path, FileStamp.of(file, st)).parse()
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror or e}", file=file) from e


class _Parser:
    """The offset walk. `pos` only moves forward; every read is bounds-checked against the file size first.

    The header is read into `buf` as the walk needs it, in chunks of at least 256 KiB (a plain read, not a mapping:
    a file truncated under us is a short read and a clean error here, never a SIGBUS).
    """

    CHUNK = 256 << 10

    def __init__(self, f, size: int, path: Path, stamp: FileStamp):
        self.f, self.size, self.path, self.file, self.stamp = f, size, path, str(path), stamp
        self.buf = bytearray()
        self.pos = 0

    def load(self, end: int) -> None:
        """Make buf hold the file's bytes [0, end)."""
        if end <= len(self.buf):
            return
        want = max(end, min(len(self.buf) + self.CHUNK, self.size, MAX_HEADER_BYTES))
        self.f.seek(len(self.buf))
        while len(self.buf) < want:
            got = self.f.read(want - len(self.buf))
            if not got:
                break
            self.buf += got
        if len(self.buf) < end:
            raise self.fail(f"the file ended at byte {len(self.buf)} while reading the header (it was {self.size} "
                            f"bytes when opened); {_REDOWNLOAD}")

    # -- primitives -------------------------------------------------------------------------------------------------
    def fail(self, message: str, tensor: str | None = None) -> CheckpointError:
        return CheckpointError(message, file=self.file, tensor=tensor)

    def need(self, n: int, what: str, tensor: str | None = None) -> None:
        left = self.size - self.pos
        if n > left:
            raise self.fail(f"{what} needs {n} bytes at offset {self.pos} but the file has {left} left: "
                            f"truncated or corrupt; {_REDOWNLOAD}", tensor)
        if self.pos + n > MAX_HEADER_BYTES:
            raise self.fail(f"{what} ({n} bytes at offset {self.pos}) would take the header past "
                            f"{MAX_HEADER_BYTES >> 20} MiB: a corrupt length; {_REDOWNLOAD}", tensor)
        self.load(self.pos + n)

    def unpack(self, code: str, what: str, tensor: str | None = None) -> Any:
        n = struct.calcsize("<" + code)
        self.need(n, what, tensor)
        (v,) = struct.unpack_from("<" + code, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str, tensor: str | None = None, limit: int | None = None) -> str:
        n = self.unpack("Q", f"the length of {what}", tensor)
        if limit is not None and n > limit:
            raise self.fail(f"{what} is {n} bytes long, over the limit of {limit}; {_REDOWNLOAD}", tensor)
        self.need(n, f"{what} ({n} bytes)", tensor)
        raw = bytes(self.buf[self.pos:self.pos + n])
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 (byte {e.start} of {n}); {_REDOWNLOAD}", tensor) from None
        self.pos += n
        return text

    # -- header ----------------------------------------------------------------------------------------------------
    def parse(self) -> GGUFFile:
        self.load(24)
        magic = bytes(self.buf[0:4])
        if magic != MAGIC:
            raise self.fail(f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        self.pos = 4
        version = self.unpack("I", "the version")
        if version & 0xFFFF == 0 and version:
            raise self.fail(
                f"the version field reads {version:#010x}: a big-endian GGUF; sluice reads little-endian files only, "
                "convert it with gguf-py's gguf_convert_endian.py or download the little-endian file"
            )
        if version not in VERSIONS:
            hint = ("GGUF v1 is obsolete: re-convert the model with a current llama.cpp" if version == 1
                    else "sluice reads GGUF versions 2 and 3")
            raise self.fail(f"GGUF version {version} is not supported; {hint}")
        n_tensors = self.unpack("Q", "the tensor count")
        n_kv = self.unpack("Q", "the metadata count")
        left = min(self.size, MAX_HEADER_BYTES) - self.pos
        # the smallest key-value pair is 14 bytes (8 length + 1 key byte + 4 type + 1 value byte), the smallest
        # tensor info 33 (8 + 1 name byte + 4 n_dims + 8 dim + 4 type + 8 offset)
        if n_kv * 14 > left or n_tensors * 33 > left:
            raise self.fail(f"header claims {n_kv} metadata entries and {n_tensors} tensors, more than the "
                            f"{left} bytes left can hold: truncated or corrupt; {_REDOWNLOAD}")

        out = GGUFFile(self.path, version, DEFAULT_ALIGNMENT, 0, {}, {})
        for _ in range(n_kv):
            self.kv(out)
        out.alignment = self.alignment(out)
        infos = [self.tensor_info(i) for i in range(n_tensors)]
        self.place(out, infos)
        return out

    def kv(self, out: GGUFFile) -> None:
        key = self.string(f"metadata key {len(out.metadata)}", limit=MAX_KEY)
        if not key:
            raise self.fail(f"metadata key {len(out.metadata)} is empty; {_REDOWNLOAD}")
        if key in out.metadata:
            raise self.fail(f"metadata key {key!r} appears twice; {_REDOWNLOAD}")
        vtype = self.unpack("I", f"the value type of {key!r}")
        if vtype == ARRAY:
            sub = self.unpack("I", f"the element type of {key!r}")
            out.array_types[key] = sub
            out.metadata[key] = self.array(sub, key, 1)
        else:
            out.metadata[key] = self.value(vtype, key, 0)
        out.types[key] = vtype

    def value(self, vtype: int, key: str, depth: int) -> Any:
        if vtype == 7:
            return self.bools(1, key)[0]
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype][1], f"the value of {key!r}")
        if vtype == STRING:
            return self.string(f"the string value of {key!r}")
        if vtype == ARRAY:  # an array inside an array
            if depth >= MAX_NESTING:
                raise self.fail(f"metadata {key!r} nests arrays deeper than {MAX_NESTING} levels; {_REDOWNLOAD}")
            sub = self.unpack("I", f"the element type of an array in {key!r}")
            return self.array(sub, key, depth + 1)
        raise self.fail(f"metadata {key!r} has unknown value type {vtype}; {_REDOWNLOAD}")

    def array(self, sub: int, key: str, depth: int) -> list:
        n = self.unpack("Q", f"the length of array {key!r}")
        if sub not in _SCALARS and sub not in (STRING, ARRAY):
            raise self.fail(f"metadata array {key!r} has unknown element type {sub}; {_REDOWNLOAD}")
        smallest = {STRING: 8, ARRAY: 12}.get(sub) or _SCALARS[sub][2]  # bytes the shortest element takes
        self.need(n * smallest, f"array {key!r} of {n} {type_name(sub)}")
        if sub == 7:
            return self.bools(n, key)
        if sub in _SCALARS:
            _, code, width = _SCALARS[sub]
            values = list(struct.unpack_from(f"<{n}{code}", self.buf, self.pos))
            self.pos += n * width
            return values
        if sub == STRING:
            return self.strings(n, key)
        return [self.value(ARRAY, key, depth) for _ in range(n)]

    def strings(self, n: int, key: str) -> list[str]:
        """`n` strings, inlined: token lists and merges hold ~150k each (Qwen), and per-string method calls took 4 s
        for 300k strings here where this loop takes ~0.3 s. The same checks as string()."""
        out: list[str] = []
        buf, length = self.buf, _U64.unpack_from  # buf grows in place (bytearray +=), so the alias stays valid
        pos = self.pos
        for i in range(n):
            if pos + 8 > len(buf):
                self.pos = pos
                self.need(8, f"the length of element {i} of {key!r}")
            (k,) = length(buf, pos)
            pos += 8
            if pos + k > len(buf):
                self.pos = pos
                self.need(k, f"element {i} of {key!r} ({k} bytes)")
            try:
                out.append(buf[pos:pos + k].decode("utf-8"))
            except UnicodeDecodeError as e:
                raise self.fail(f"element {i} of {key!r} is not valid UTF-8 (byte {e.start} of {k}); "
                                f"{_REDOWNLOAD}") from None
            pos += k
        self.pos = pos
        return out

    def bools(self, n: int, key: str) -> list[bool]:
        self.need(n, f"the value of {key!r}")
        raw = bytes(self.buf[self.pos:self.pos + n])
        if raw.translate(None, b"\x00\x01"):
            raise self.fail(f"metadata {key!r} holds a bool that is neither 0 nor 1; {_REDOWNLOAD}")
        self.pos += n
        return [b == 1 for b in raw]

    def alignment(self, out: GGUFFile) -> int:
        if "general.alignment" not in out.metadata:
            return DEFAULT_ALIGNMENT
        a, t = out.metadata["general.alignment"], out.types["general.alignment"]
        if t != 4:
            raise self.fail(f"general.alignment must be a u32, got a {out.type_of('general.alignment')}; "
                            f"{_REDOWNLOAD}")
        if a == 0 or a & (a - 1):
            raise self.fail(f"general.alignment {a} is not a power of two; {_REDOWNLOAD}")
        return a

    # -- tensors ---------------------------------------------------------------------------------------------------
    def tensor_info(self, i: int) -> tuple[str, tuple[int, ...], str, int, int]:
        """(name, torch-order shape, ggml type name, offset relative to the data section, nbytes)."""
        name = self.string(f"the name of tensor {i}", limit=MAX_NAME - 1)  # llama.cpp's limit
        if not name:
            raise self.fail(f"tensor {i} has an empty name; {_REDOWNLOAD}")
        n_dims = self.unpack("I", "the number of dimensions", name)
        if not 1 <= n_dims <= MAX_DIMS:
            raise self.fail(f"has {n_dims} dimensions; GGUF tensors have 1 to {MAX_DIMS}; {_REDOWNLOAD}", name)
        self.need(8 * n_dims, "the dimensions", name)
        dims = struct.unpack_from(f"<{n_dims}Q", self.buf, self.pos)
        self.pos += 8 * n_dims
        numel = math.prod(dims)
        if min(dims) < 1 or numel >= 2**63:
            raise self.fail(f"dims {list(dims)}: every dim must be >= 1 and their product below 2^63; "
                            f"{_REDOWNLOAD}", name)
        type_id = self.unpack("I", "the ggml type", name)
        fmt = BY_ID.get(type_id)
        if fmt is None:
            raise self.fail(f"has ggml type id {type_id}, which no ggml version defines; the file is corrupt or "
                            "newer than sluice: " + _REDOWNLOAD, name)
        if fmt.name not in SUPPORTED:
            raise self.fail(f"{fmt.name} is not supported: supported {', '.join(sorted(SUPPORTED))}; re-quantize "
                            "the model to one of these (llama-quantize)", name)
        if dims[0] % fmt.block_elems:
            raise self.fail(f"rows of {dims[0]} values are not whole {fmt.name} blocks of {fmt.block_elems}; "
                            f"{_REDOWNLOAD}", name)
        nbytes = numel // dims[0] * fmt.row_nbytes(dims[0])
        offset = self.unpack("Q", "the data offset", name)
        return name, tuple(reversed(dims)), fmt.name, offset, nbytes

    def place(self, out: GGUFFile, infos: list[tuple[str, tuple[int, ...], str, int, int]]) -> None:
        """Check the data layout (see the module docstring) and record every tensor with its absolute offset."""
        a = out.alignment
        header_end = self.pos
        data_start = -(-header_end // a) * a
        out.data_start = data_start if infos else header_end  # llama.cpp aligns only when there are tensors
        expected, prev = 0, None  # where the next tensor must start (relative), the tensor before it
        if infos and out.data_start > self.size:
            raise self.fail(f"the data section starts at byte {out.data_start}, past the end of the {self.size}-byte "
                            f"file: truncated; {_REDOWNLOAD}")
        for name, shape, dtype, offset, nbytes in infos:
            if name in out.tensors:
                raise self.fail(f"two tensors have this name; {_REDOWNLOAD}", name)
            if offset != expected:
                if offset % a:
                    why = f"is not a multiple of the alignment {a}"
                elif offset < expected:
                    why = f"overlaps {prev!r}, which ends at {expected}" if prev else "must be 0 for the first tensor"
                else:
                    why = (f"leaves a gap of {offset - expected} bytes after {prev!r}" if prev
                           else "must be 0 for the first tensor")
                raise self.fail(f"data offset {offset} {why}; GGUF places each tensor at the aligned end of the "
                                f"previous one (expected {expected}); {_REDOWNLOAD}", name)
            end = out.data_start + offset + nbytes
            if end > self.size:
                raise self.fail(f"data ends at byte {end} but the file has {self.size} bytes: truncated, "
                                f"{end - self.size} bytes missing; {_REDOWNLOAD}", name)
            out.tensors[name] = TensorRef(name, str(self.path), out.data_start + offset, nbytes, dtype, shape,
                                          stamp=self.stamp)
            expected, prev = -(-(offset + nbytes) // a) * a, name
        last_end = out.tensors[prev].offset + out.tensors[prev].nbytes if prev else header_end
        padded_end = out.data_start + expected if prev else data_start
        if self.size > padded_end:
            raise self.fail(f"{self.size - padded_end} bytes follow the end of the last tensor's data (byte "
                            f"{last_end}, padded to {padded_end}); a GGUF file ends there: {_REDOWNLOAD}")
        if last_end < self.size < padded_end:
            raise self.fail(f"the file ends at byte {self.size}, inside the padding after the last tensor's data "
                            f"(it ends at {last_end}, or padded at {padded_end}): truncated; {_REDOWNLOAD}")
