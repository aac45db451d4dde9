"""read_header / write_safetensors: byte-for-byte round trips against the reference package, and every check."""

from __future__ import annotations

import json
import os
import random
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sluice.checkpoint import DTYPES, TensorRef, read_header, write_safetensors
from sluice.errors import CheckpointError
from sluice.quant.tensor import read_tensor


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    f32 = torch.randn(3, 5, generator=g)
    return {
        "f32": f32,
        "f64": torch.randn(4, generator=g, dtype=torch.float64),
        "f16": torch.randn(2, 3, generator=g).half(),
        "bf16": torch.randn(7, 3, generator=g).bfloat16(),
        "fp8_e4m3": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
        "fp8_e5m2": torch.randn(2, 8, generator=g).to(torch.float8_e5m2),
        "i8": torch.randint(-128, 127, (9,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (3, 3), generator=g, dtype=torch.uint8),
        "i16": torch.randint(-1000, 1000, (5,), generator=g, dtype=torch.int16),
        "i32": torch.randint(-(2**31), 2**31 - 1, (2, 2), generator=g, dtype=torch.int32),
        "u32": torch.randint(0, 2**31, (4,), generator=g, dtype=torch.int64).to(torch.uint32),
        "i64": torch.randint(-(2**62), 2**62, (3,), generator=g, dtype=torch.int64),
        "bool": torch.rand(6, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 4),
        "empty_bf16": torch.zeros(2, 0, dtype=torch.bfloat16),
    }


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert raw_bytes(a) == raw_bytes(b)


def write_raw(path: Path, header: object, data: bytes = b"", *, header_len: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# --- round trips ---------------------------------------------------------------------------------------------


def test_reads_reference_writer_byte_for_byte(tmp_path: Path) -> None:
    tensors = sample_tensors()
    path = tmp_path / "ref.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "hi"})
    refs, meta = read_header(path)
    assert meta == {"format": "pt", "note": "hi"}
    assert set(refs) == set(tensors)
    blob = path.read_bytes()
    for name, t in tensors.items():
        ref = refs[name]
        assert isinstance(ref, TensorRef)
        assert ref.name == name and ref.path == str(path)
        assert ref.shape == tuple(t.shape) and ref.torch_dtype == t.dtype
        assert ref.nbytes == t.numel() * t.element_size()
        assert blob[ref.offset : ref.offset + ref.nbytes] == raw_bytes(t)


def test_reference_reader_loads_our_files(tmp_path: Path) -> None:
    tensors = sample_tensors()
    path = write_safetensors(tmp_path / "ours.safetensors", tensors, {"format": "pt"})
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert_same(loaded[name], t)
    # and our own reader agrees, with tensors packed in the order given
    refs, meta = read_header(path)
    assert meta == {"format": "pt"} and list(refs) == list(tensors)
    assert (refs["f32"].offset - 8) % 8 == 0  # data starts 8-byte aligned


def test_writer_handles_views_and_no_metadata(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {"t": base.t(), "slice": base[:, 1:3], "bf16_t": base.bfloat16().t()}
    path = write_safetensors(tmp_path / "v.safetensors", tensors)
    loaded = load_file(str(path))
    for name, t in tensors.items():
        assert_same(loaded[name], t.contiguous())
    assert read_header(path)[1] == {}


def test_writer_leaves_nothing_on_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    with pytest.raises(CheckpointError, match="complex"):
        write_safetensors(path, {"ok": torch.ones(2), "c": torch.ones(2, dtype=torch.complex64)})
    assert list(tmp_path.iterdir()) == []


def test_empty_file_of_tensors(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "none.safetensors", {})
    assert read_header(path) == ({}, {})
    assert load_file(str(path)) == {}


def test_dtype_table_matches_brief() -> None:
    assert set(DTYPES) == {"F64", "F32", "F16", "BF16", "I8", "U8", "I16", "I32", "I64", "U32", "BOOL",
                           "F8_E4M3", "F8_E5M2"}


def test_five_thousand_tensors_in_any_order_are_each_read(tmp_path: Path) -> None:
    """A header listing its tensors out of data order (the coverage check sorts them): each one's own offset."""
    order = list(range(5000))
    random.Random(0).shuffle(order)
    header = {f"t{i}": entry("F32", [2], 8 * i, 8 * i + 8) for i in order}
    path = write_raw(tmp_path / "many.safetensors", header, bytes(8 * 5000))
    refs, _ = read_header(path)
    base = path.stat().st_size - 8 * 5000  # the data section's start
    assert sorted(refs) == sorted(header)
    assert all(refs[f"t{i}"].offset == base + 8 * i and refs[f"t{i}"].nbytes == 8 for i in range(5000))


# --- validation ----------------------------------------------------------------------------------------------


def check_error(path: Path, *fragments: str, tensor: str | None = None) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    err = info.value
    msg = str(err)
    assert path.name in msg and err.file == str(path)
    for frag in fragments:
        assert frag in msg, msg
    if tensor is not None:
        assert err.tensor == tensor and repr(tensor) in msg
    return err


def test_shorter_than_length_prefix(tmp_path: Path) -> None:
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x01\x02\x03")
    check_error(path, "shorter than the 8-byte", "re-download")


@pytest.mark.parametrize(
    "n, words",
    [(0, "header length is 0"), (200 * 1024 * 1024, "exceeds"), (1000, "past the end")],
)
def test_bad_header_length(tmp_path: Path, n: int, words: str) -> None:
    path = write_raw(tmp_path / "len.safetensors", {}, header_len=n)
    check_error(path, words)


def test_header_not_json(tmp_path: Path) -> None:
    check_error(write_raw(tmp_path / "j.safetensors", b'{"a": '), "not valid JSON")
    check_error(write_raw(tmp_path / "u.safetensors", b'{"\xff": 1}'), "UTF-8")
    check_error(write_raw(tmp_path / "l.safetensors", b"[1, 2]"), "expected an object")


def test_duplicate_names(tmp_path: Path) -> None:
    one = '{"dtype":"U8","shape":[1],"data_offsets":[%d,%d]}'
    raw = ('{"w": ' + one % (0, 1) + ', "w": ' + one % (1, 2) + "}").encode()
    check_error(write_raw(tmp_path / "dup.safetensors", raw, b"ab"), "twice", tensor="w")


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"dtype": "F32", "shape": [1]}, "lacks data_offsets"),
        ([1, 2], "expected an object"),
        (entry("F32", [1], 0, 4) | {"shape": "1"}, "not a list of integers"),
        (entry("F32", [1], 0, 4) | {"shape": [True]}, "not a list of integers"),
        (entry("F32", [1], 0, 4) | {"dtype": 4}, "not a string"),
        (entry("F32", [1], 0, 4) | {"data_offsets": [0]}, "data_offsets"),
        (entry("F32", [-1], 0, 4), "negative"),
        (entry("F32", [1], 4, 0), "not a valid range"),
        (entry("F32", [1], -4, 0), "not a valid range"),
    ],
)
def test_malformed_entries(tmp_path: Path, bad: object, words: str) -> None:
    path = write_raw(tmp_path / "e.safetensors", {"layer.w": bad}, bytes(8))
    check_error(path, words, tensor="layer.w")


def test_unknown_dtype_lists_known(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "d.safetensors", {"w": entry("C64", [1], 0, 8)}, bytes(8))
    check_error(path, "unknown dtype 'C64'", "BF16", "F8_E4M3", "F64", tensor="w")


def test_nbytes_mismatch(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "n.safetensors", {"w": entry("BF16", [2, 3], 0, 8)}, bytes(8))
    check_error(path, "holds 8 bytes", "needs 12", tensor="w")


def test_truncated_file_says_bytes_missing(tmp_path: Path) -> None:
    full = write_safetensors(tmp_path / "full.safetensors", {"a": torch.ones(4), "b": torch.ones(8)})
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(full.read_bytes()[:-10])
    check_error(cut, "truncated", "10 bytes missing", tensor="b")


def test_offsets_past_end(tmp_path: Path) -> None:
    header = {"a": entry("U8", [4], 0, 4), "far": entry("U8", [4], 100, 104)}
    check_error(write_raw(tmp_path / "p.safetensors", header, bytes(8)), "96 bytes missing", tensor="far")


def test_overlap_names_both(tmp_path: Path) -> None:
    header = {"a": entry("U8", [8], 0, 8), "z": entry("U8", [2], 16, 18), "b": entry("U8", [4], 6, 10)}
    err = check_error(write_raw(tmp_path / "o.safetensors", header, bytes(18)), "overlap", tensor="b")
    assert "'a'" in str(err)


def test_zero_size_tensors_may_share_offsets(tmp_path: Path) -> None:
    header = {"a": entry("F32", [2], 0, 8), "e": entry("F32", [0, 3], 8, 8), "e2": entry("U8", [0], 8, 8),
              "s": entry("U8", [], 8, 9)}
    path = write_raw(tmp_path / "z.safetensors", header, bytes(9))
    refs, _ = read_header(path)
    assert refs["e"].nbytes == 0 and refs["s"].shape == () and refs["s"].nbytes == 1
    assert set(load_file(str(path))) == set(header)  # the reference agrees


def test_zero_size_tensor_inside_another_is_refused(tmp_path: Path) -> None:
    # The reference refuses it too ("invalid offset"): sorted by offsets, each tensor must begin where the last ended.
    header = {"a": entry("F32", [2], 0, 8), "e": entry("F32", [0, 3], 4, 4)}
    check_error(write_raw(tmp_path / "z.safetensors", header, bytes(8)), "overlap", "'a'", tensor="e")


def test_missing_file(tmp_path: Path) -> None:
    check_error(tmp_path / "nope.safetensors", "cannot read")


# --- what the format requires (issue 12): the tensors tile the data section, nothing shifted -----------------------


def reference_rejects(path: Path) -> bool:
    try:
        load_file(str(path))
    except Exception:  # noqa: BLE001 - the reference raises SafetensorError, or a torch error for absurd shapes
        return True
    return False


def test_header_length_cut_into_padding_is_refused(tmp_path: Path) -> None:
    """The issue's case: a length field reduced by 2 still parses (the header ends in space padding), but every
    tensor would be read 2 bytes early. The reference refuses it; so must we."""
    for name in ("w", "ww", "www", "wwww"):  # one of 4 consecutive name lengths pads the header by >= 2 spaces
        good = write_safetensors(tmp_path / "good.safetensors", {name: torch.arange(6, dtype=torch.float32)})
        blob = good.read_bytes()
        (n,) = struct.unpack("<Q", blob[:8])
        if blob[8 + n - 2 : 8 + n] == b"  ":  # the padding the cut lands in
            break
    assert read_header(good)[0][name].nbytes == 24
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(struct.pack("<Q", n - 2) + blob[8:])
    assert reference_rejects(cut)
    check_error(cut, "2 bytes are left over", "would shift every tensor")


@pytest.mark.parametrize(
    "header, data, words, tensor",
    [
        ({"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 4, 6)}, 6, "leaving bytes [2, 4) after tensor 'a'", "b"),
        ({"a": entry("U8", [2], 2, 4)}, 4, "at the start of the data section", "a"),
        ({"a": entry("U8", [2], 0, 2)}, 5, "3 bytes are left over", None),
        ({}, 3, "lists no tensors", None),
        ({"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 0, 2)}, 2, "overlap tensor 'a'", "b"),
    ],
)
def test_data_section_must_be_covered_exactly(tmp_path: Path, header, data, words, tensor) -> None:
    path = write_raw(tmp_path / "c.safetensors", header, bytes(data))
    assert reference_rejects(path)
    check_error(path, words, tensor=tensor)


def test_header_must_start_with_brace(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "s.safetensors", b' {"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}', bytes(2))
    check_error(path, "does not start with '{'")


@pytest.mark.parametrize(
    "shape, dtype",
    [([0, 2**63], "F32"), ([0, 2**64 - 1], "U8"), ([0, 2**62], "F32"), ([2**40, 2**40, 0], "U8"),
     ([0] + [2**62] * 9999, "U8")],
)
def test_absurd_shapes_are_refused(tmp_path: Path, shape: list[int], dtype: str) -> None:
    """Zero elements, but a dimension (or a product of them) no int64 can hold: torch cannot build it."""
    path = write_raw(tmp_path / "big.safetensors", {"e": entry(dtype, shape, 0, 0)})
    check_error(path, "too large for any tensor", tensor="e")


def test_largest_representable_empty_shape_reads(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "e.safetensors", {"e": entry("U8", [0, 2**63 - 1], 0, 0)})
    refs, _ = read_header(path)
    assert read_tensor(refs["e"]).shape == (0, 2**63 - 1)


@pytest.mark.parametrize(
    "raw, words",
    [
        (b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"x":' + b"[" * 200 + b"]" * 200 + b"}}", "nested"),
        (b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
        (b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"x":' + b"9" * 5000 + b"}}", "number too long"),
        (b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"x":NaN}}', "NaN"),
        (b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"x":1e999}}', "out of the range"),
        (b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[-0,2]}}', "not [begin, end] integers"),
        (b'{"\\ud800":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}', "lone UTF-16 surrogate"),
        (b'{"a":{"dtype":"U8","dtype":"U8","shape":[2],"data_offsets":[0,2]}}', "'dtype' twice"),
    ],
    ids=["deep-extra", "deep-recursion", "huge-int", "nan", "inf", "negative-zero", "surrogate", "dup-field"],
)
def test_hostile_json_is_a_checkpoint_error(tmp_path: Path, raw: bytes, words: str) -> None:
    """Each is refused by the reference too; Python's json would raise RecursionError / ValueError or accept."""
    path = write_raw(tmp_path / "h.safetensors", raw, bytes(2))
    assert reference_rejects(path)
    check_error(path, words)


def test_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    result: list[BaseException | None] = []

    def target() -> None:
        try:
            read_header(fifo)
        except BaseException as e:  # noqa: BLE001 - handed to the assertion below
            result.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # unblock the stuck open() so the thread ends
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert result and isinstance(result[0], CheckpointError) and "not a regular file" in str(result[0])
