"""GGUF header reader: agrees with gguf.GGUFReader on every tensor of files the `gguf` package writes (every
supported type, custom alignment, v2), and refuses every malformed header with a CheckpointError that names the
file, the tensor or key, and what is wrong."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from sluice.checkpoint.gguf import MAX_HEADER_BYTES, read_gguf
from sluice.checkpoint.ref import TensorRef, rope_row_order
from sluice.errors import CheckpointError
from sluice.quant.tensor import read_tensor
from sluice.checkpoint import formats
from tests.checkpoint.gguf_files import Q, add, f32_tensor_file, gguf, kv, permute, raw_gguf, s, tinfo

TYPES = [Q[name] for name in sorted(formats.SUPPORTED)]  # the quantized ones: quantized or random blocks (encode)


def write(path: Path, tensors: dict[str, tuple[np.ndarray, object]], alignment: int | None = None,
          metadata: bool = True) -> Path:
    w = gguf.GGUFWriter(path, "qwen3moe")
    if alignment:
        w.add_custom_alignment(alignment)
    if metadata:
        w.add_uint32("qwen3moe.block_count", 2)
        w.add_float32("qwen3moe.rope.freq_base", 1e6)
        w.add_bool("x.flag", True)
        w.add_array("tokenizer.ggml.tokens", ["a", "é", "<|im_end|>"])
        w.add_array("tokenizer.ggml.token_type", [1, 1, 3])
        w.add_array("x.scores", [0.5, -1.25])
        w.add_string("tokenizer.chat_template", "{{ messages }}")
        w.add_uint64("x.big", 2**40)
        w.add_int8("x.neg", -3)
    for name, (values, qtype) in tensors.items():
        add(w, name, values, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_agrees(path: Path) -> dict[str, TensorRef]:
    """Every tensor's offset, byte count, type and shape equal GGUFReader's; the metadata values equal too."""
    ours = read_gguf(path)
    ref = gguf.GGUFReader(path)
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        r = ours.tensors[t.name]
        assert (r.offset, r.nbytes, r.dtype) == (t.data_offset, t.n_bytes, t.tensor_type.name), t.name
        assert r.shape == tuple(int(d) for d in reversed(t.shape)), t.name
        with open(path, "rb") as f:
            f.seek(r.offset)
            assert f.read(r.nbytes) == np.ascontiguousarray(t.data).tobytes(), t.name
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        assert ours.metadata[key] == pytest.approx(field.contents()), key
    return ours.tensors


def test_every_supported_type_agrees_with_gguf_reader(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {f"w.{q.name}": (rng.standard_normal((3, 512)).astype(np.float32), q) for q in TYPES}
    tensors["norm"] = (rng.standard_normal(64).astype(np.float32), Q.F32)
    tensors["stack"] = (rng.standard_normal((4, 2, 256)).astype(np.float32), Q.Q4_K)  # [E, I, H]-like
    refs = assert_agrees(write(tmp_path / "m.gguf", tensors))
    for q in TYPES:
        r = refs[f"w.{q.name}"]
        assert r.shape == (3, 512) and r.dtype == q.name and r.format == formats.BY_ID[int(q)]
        assert r.nbytes == 3 * r.row_nbytes == 3 * formats.BY_ID[int(q)].row_nbytes(512)
        assert r.quantized == (q not in (Q.F32, Q.F16, Q.BF16))
    assert refs["stack"].shape == (4, 2, 256)


def test_plain_tensors_read_as_torch(tmp_path):
    rng = np.random.default_rng(1)
    v = rng.standard_normal((5, 32)).astype(np.float32)
    refs = read_gguf(write(tmp_path / "m.gguf", {"a": (v, Q.F32), "b": (v, Q.F16), "c": (v, Q.BF16)})).tensors
    assert torch.equal(read_tensor(refs["a"]), torch.from_numpy(v))
    assert torch.equal(read_tensor(refs["b"]), torch.from_numpy(v).half())
    assert torch.equal(read_tensor(refs["c"]).float(), torch.from_numpy(v).bfloat16().float())


def test_block_format_has_no_torch_dtype(tmp_path):
    v = np.ones((2, 32), np.float32)
    ref = read_gguf(write(tmp_path / "m.gguf", {"q": (v, Q.Q8_0)})).tensors["q"]
    for attr in ("torch_dtype", "itemsize"):
        with pytest.raises(CheckpointError, match=r"'q'.*Q8_0, a block format") as e:
            getattr(ref, attr)
        assert e.value.tensor == "q"
    blocks = np.fromfile(ref.path, np.uint8, ref.nbytes, offset=ref.offset)
    want = gguf.quants.dequantize(blocks, Q.Q8_0).reshape(2, 32)  # read_tensor dequantizes, as the reference does
    assert torch.equal(read_tensor(ref), torch.from_numpy(want))


@pytest.mark.parametrize("alignment", [1, 8, 64, 4096])
def test_custom_alignment(tmp_path, alignment):
    v = np.ones((3, 32), np.float32)
    refs = assert_agrees(write(tmp_path / "m.gguf", {"a": (v[0], Q.F32), "b": (v, Q.Q8_0), "c": (v, Q.F16)},
                               alignment=alignment))
    assert all(r.offset % alignment == 0 for r in refs.values())


def test_version_2_reads_like_3(tmp_path):
    path = write(tmp_path / "m.gguf", {"a": (np.ones(8, np.float32), Q.F32)})
    raw = bytearray(path.read_bytes())
    raw[4:8] = struct.pack("<I", 2)
    path.write_bytes(raw)
    f = read_gguf(path)
    assert f.version == 2 and f.tensors["a"].offset == gguf.GGUFReader(path).tensors[0].data_offset


def test_no_tensors_and_no_metadata(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(raw_gguf([], []))
    f = read_gguf(path)
    assert f.tensors == {} and f.metadata == {} and f.data_start == 24


def test_nested_arrays_and_every_scalar_type(tmp_path):
    entries = [kv(f"k{t}", t, struct.pack("<" + c, v)) for t, c, v in
               ((0, "B", 255), (1, "b", -1), (2, "H", 65535), (3, "h", -2), (4, "I", 7), (5, "i", -7),
                (6, "f", 0.5), (10, "Q", 2**64 - 1), (11, "q", -(2**63)), (12, "d", 1e-300))]
    entries.append(kv("b", 7, b"\x01"))
    inner = struct.pack("<IQ", 5, 2) + struct.pack("<2i", 1, -1)
    entries.append(kv("nested", 9, struct.pack("<IQ", 9, 2) + inner + inner))
    entries.append(kv("strs", 9, struct.pack("<IQ", 8, 2) + s("x") + s("")))
    path = tmp_path / "kv.gguf"
    path.write_bytes(raw_gguf(entries, []))
    md = read_gguf(path).metadata
    assert md["k0"] == 255 and md["k11"] == -(2**63) and md["k6"] == 0.5 and md["b"] is True
    assert md["nested"] == [[1, -1], [1, -1]] and md["strs"] == ["x", ""]
    assert gguf.GGUFReader(path).fields["strs"].contents() == ["x", ""]


def test_rope_row_order_undoes_the_converter_permutation():
    rng = np.random.default_rng(2)
    for heads, kv_heads, d in ((4, 4, 8), (4, 2, 16), (8, 1, 6)):
        q = rng.standard_normal((heads * d, 5)).astype(np.float32)
        k = rng.standard_normal((kv_heads * d, 5)).astype(np.float32)
        pq, pk = permute(q, heads, heads), permute(k, heads, kv_heads)
        assert np.array_equal(pq[rope_row_order(heads * d, heads).numpy()], q)
        assert np.array_equal(pk[rope_row_order(kv_heads * d, kv_heads).numpy()], k)
    with pytest.raises(ValueError):
        rope_row_order(10, 4)


def test_rope_row_order_is_exact_on_quantized_rows(tmp_path):
    """Each row is whole blocks, so reordering the rows of the stored bytes equals quantizing the HF-order rows."""
    rng = np.random.default_rng(3)
    heads, d, hidden = 4, 8, 64
    q = rng.standard_normal((heads * d, hidden)).astype(np.float32)
    stored = gguf.quants.quantize(permute(q, heads, heads), Q.Q8_0)  # [rows, row bytes]
    order = rope_row_order(heads * d, heads).numpy()
    assert np.array_equal(stored[order], gguf.quants.quantize(q, Q.Q8_0))


def _stored_ref(tmp_path: Path, values: np.ndarray, how: str, dtype: str = "F32") -> TensorRef:
    path = tmp_path / "v.bin"
    data = values.astype(np.float32 if dtype == "F32" else np.float16)
    path.write_bytes(data.tobytes())
    return TensorRef("blk.0.t", str(path), 0, data.nbytes, dtype, values.shape, values=how)


def test_stored_values_read_back_as_the_hugging_face_values(tmp_path):
    """What a converter does to values (TensorRef.values: llama.cpp's and mlx-lm's 1 + w norms, llama.cpp's
    -exp(A_log)) is undone by read_tensor, in float32, for every map STORED knows and both ways round."""
    from sluice.checkpoint.ref import STORED

    w = torch.tensor([[-0.4, -0.01, 0.0], [0.02, 0.3, 1.7]])
    for how, m in STORED.items():
        stored = m.store(w)
        got = read_tensor(_stored_ref(tmp_path, stored.numpy(), how))
        torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-7, msg=how)
        if how == "plus_one":  # 1 + (scale - 1) is the stored scale again, bit for bit: what llama.cpp multiplies by
            assert torch.equal(m.store(got), stored)
        torch.testing.assert_close(m.store(got), stored, rtol=3e-7, atol=0, msg=how)
    half = read_tensor(_stored_ref(tmp_path, (w + 1).numpy(), "plus_one", "F16"))
    assert half.dtype == torch.float16  # a plain tensor keeps its dtype
    torch.testing.assert_close(half.float(), w, rtol=0, atol=1e-3)


def test_stored_values_the_map_cannot_give_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"values >= 0 where the converter stores -exp\(A_log\)") as e:
        read_tensor(_stored_ref(tmp_path, np.array([-1.0, 0.5]), "neg_exp"))
    assert e.value.tensor == "blk.0.t"
    with pytest.raises(CheckpointError, match="values stored as 'cube'"):
        read_tensor(_stored_ref(tmp_path, np.array([1.0]), "cube"))


# -- malformed headers: one test per rule -----------------------------------------------------------------------------
def check(tmp_path: Path, raw: bytes, pattern: str, tensor: str | None = None) -> CheckpointError:
    path = tmp_path / "bad.gguf"
    path.write_bytes(raw)
    with pytest.raises(CheckpointError, match=pattern) as e:
        read_gguf(path)
    assert e.value.file == str(path)
    if tensor is not None:
        assert e.value.tensor == tensor
    return e.value


def test_short_and_wrong_magic(tmp_path):
    check(tmp_path, b"GGUF\x03\0\0\0", r"8 bytes, shorter than the 24-byte GGUF header")
    check(tmp_path, b"GGML" + b"\0" * 40, r"not a GGUF file \(starts with b'GGML'")


def test_versions(tmp_path):
    check(tmp_path, raw_gguf([], [], version=1), r"version 1 is not supported; GGUF v1 is obsolete")
    check(tmp_path, raw_gguf([], [], version=4), r"version 4 is not supported; sluice reads GGUF versions 2 and 3")
    check(tmp_path, raw_gguf([], [], version=0), r"version 0 is not supported")


def test_big_endian_is_refused_clearly(tmp_path):
    path = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(path, "qwen3moe", endianess=gguf.GGUFEndian.BIG)
    w.add_tensor("a", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"big-endian GGUF; sluice reads little-endian files only"):
        read_gguf(path)


@pytest.mark.parametrize("cut", [10, 24, 30, 60, 90, 140])
def test_truncated_header(tmp_path, cut):
    raw, _ = f32_tensor_file()
    check(tmp_path, raw[:cut], r"truncated|shorter than")


def test_truncated_data_names_the_tensor(tmp_path):
    raw, _ = f32_tensor_file()
    e = check(tmp_path, raw[:-10], r"data ends at byte \d+ but the file has \d+ bytes: truncated", tensor="t2")
    assert "re-download" in str(e)


def test_counts_beyond_the_file(tmp_path):
    raw = bytearray(f32_tensor_file()[0])
    raw[16:24] = struct.pack("<Q", 2**40)  # kv_count
    check(tmp_path, bytes(raw), r"claims 1099511627776 metadata entries .* more than the \d+ bytes left")


def test_string_length_beyond_the_file(tmp_path):
    huge = struct.pack("<Q", 2**62) + b"key"
    check(tmp_path, raw_gguf([huge], []) + b"\0" * 64, r"metadata key 0 is 4611686018427387904 bytes long, over the "
          "limit of 65535")
    check(tmp_path, raw_gguf([kv("k", 8, struct.pack("<Q", 10**12))], []), r"string value of 'k' .* truncated")


def test_array_count_beyond_the_file(tmp_path):
    check(tmp_path, raw_gguf([kv("k", 9, struct.pack("<IQ", 6, 2**61))], []),
          r"array 'k' of 2305843009213693952 f32 needs")


def test_header_bound(tmp_path):
    big = MAX_HEADER_BYTES + 10
    path = tmp_path / "bad.gguf"
    with open(path, "wb") as f:  # a sparse file: the string claims more than the header limit, inside the file
        f.write(raw_gguf([kv("k", 8, struct.pack("<Q", big))], []))
        f.truncate(big + 100)
    with pytest.raises(CheckpointError, match=r"past 128 MiB: a corrupt length"):
        read_gguf(path)


def test_metadata_rules(tmp_path):
    check(tmp_path, raw_gguf([kv("k", 13, b"\0")], []), r"'k' has unknown value type 13")
    check(tmp_path, raw_gguf([kv("k", 9, struct.pack("<IQ", 42, 1))], []), r"array 'k' has unknown element type 42")
    check(tmp_path, raw_gguf([kv("k", 4, b"\1\0\0\0")] * 2, []), r"metadata key 'k' appears twice")
    check(tmp_path, raw_gguf([kv("", 4, b"\1\0\0\0")], []), r"metadata key 0 is empty")
    check(tmp_path, raw_gguf([s(b"\xff\xfe") + struct.pack("<IB", 0, 1)], []), r"metadata key 0 is not valid UTF-8")
    check(tmp_path, raw_gguf([kv("k", 8, s(b"a\xc3"))], []), r"string value of 'k' is not valid UTF-8")
    check(tmp_path, raw_gguf([kv("k", 7, b"\x02")], []), r"'k' holds a bool that is neither 0 nor 1")
    strs = struct.pack("<IQ", 8, 2) + s("ok") + s(b"\xff")
    check(tmp_path, raw_gguf([kv("k", 9, strs)], []), r"element 1 of 'k' is not valid UTF-8")
    cut = struct.pack("<IQ", 8, 2) + s("ok") + struct.pack("<Q", 10**6) + b"abc"
    check(tmp_path, raw_gguf([kv("k", 9, cut)], []), r"element 1 of 'k' \(1000000 bytes\) needs .* truncated")
    deep = struct.pack("<IQ", 9, 1) * 9 + struct.pack("<IQ", 4, 0)
    check(tmp_path, raw_gguf([kv("k", 9, deep)], []), r"nests arrays deeper than 8 levels")


def test_alignment_rules(tmp_path):
    check(tmp_path, raw_gguf([kv("general.alignment", 10, struct.pack("<Q", 32))], []),
          r"general.alignment must be a u32, got a u64")
    check(tmp_path, raw_gguf([kv("general.alignment", 4, struct.pack("<I", 48))], []),
          r"general.alignment 48 is not a power of two")
    check(tmp_path, raw_gguf([kv("general.alignment", 4, struct.pack("<I", 0))], []),
          r"general.alignment 0 is not a power of two")


def test_tensor_info_rules(tmp_path):
    data = b"\0" * 64

    def one(info: bytes, pattern: str, tensor: str | None = "t") -> None:
        check(tmp_path, raw_gguf([], [info], data), pattern, tensor)

    one(tinfo("t", (), 0, 0), r"has 0 dimensions; GGUF tensors have 1 to 4")
    one(tinfo("t", (1, 1, 1, 1, 1), 0, 0), r"has 5 dimensions")
    one(tinfo("t", (4, 0), 0, 0), r"dims \[4, 0\]: every dim must be >= 1")
    one(tinfo("t", (2**32, 2**32), 0, 0), r"product below 2\^63")
    one(tinfo("t", (4,), 99, 0), r"ggml type id 99, which no ggml version defines")
    one(tinfo("t", (256,), 15, 0), r"Q8_K is not supported: supported BF16, F16, F32, IQ1_M")
    one(tinfo("t", (40,), 8, 0), r"rows of 40 values are not whole Q8_0 blocks of 32")
    one(tinfo("", (4,), 0, 0), r"tensor 0 has an empty name", None)
    one(tinfo("x" * 64, (4,), 0, 0), r"the name of tensor 0 is 64 bytes long, over the limit of 63", None)
    one(tinfo("t", (4,), 0, 8), r"data offset 8 is not a multiple of the alignment 32")
    one(tinfo("t", (4,), 0, 32), r"data offset 32 must be 0 for the first tensor")


def test_layout_rules(tmp_path):
    a, b = tinfo("a", (8,), 0, 0), tinfo("b", (8,), 0, 32)
    data = b"\0" * 64
    check(tmp_path, raw_gguf([], [a, tinfo("a", (8,), 0, 32)], data), r"two tensors have this name", "a")
    check(tmp_path, raw_gguf([], [a, tinfo("b", (8,), 0, 64)], data + b"\0" * 32),
          r"offset 64 leaves a gap of 32 bytes after 'a'.*expected 32", "b")
    check(tmp_path, raw_gguf([], [tinfo("a", (16,), 0, 0), b], data), r"offset 32 overlaps 'a', which ends at 64",
          "b")
    check(tmp_path, raw_gguf([], [a, b], data + b"\0"), r"1 bytes follow the end of the last tensor's data")
    # the last tensor ends at 40: the file may end there or at its padded end 64, nowhere else
    short_b = tinfo("b", (2,), 0, 32)
    path = tmp_path / "ok.gguf"
    for end in (40, 64):
        path.write_bytes(raw_gguf([], [a, short_b], data[:end]))
        assert read_gguf(path).tensors["b"].nbytes == 8
    check(tmp_path, raw_gguf([], [a, short_b], data[:39]), r"truncated", "b")
    check(tmp_path, raw_gguf([], [a, short_b], data[:41]), r"ends at byte \d+, inside the padding after the last "
          r"tensor's data \(it ends at \d+, or padded at \d+\): truncated")


def test_data_section_past_the_end(tmp_path):
    head = raw_gguf([], [tinfo("a", (8,), 0, 0)])  # padded header, no data
    check(tmp_path, head[: len(head) - 3], r"data section starts at byte \d+, past the end")


def test_unreadable_path(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read"):
        read_gguf(tmp_path / "missing.gguf")


def test_tensor_ref_formats_of_plain_codes():
    f32 = TensorRef("w", "p", 0, 48, "F32", (3, 4))
    assert not f32.quantized and f32.format.name == "F32" and f32.row_nbytes == 16 and f32.row_order() is None
    u8 = TensorRef("m", "p", 0, 4, "U8", (4,))  # a safetensors code with no ggml type
    assert not u8.quantized and u8.itemsize == 1 and u8.row_nbytes == 4
    with pytest.raises(CheckpointError, match="dtype U8 is not a ggml type"):
        u8.format
    q = TensorRef("q", "p", 0, 2 * 144, "Q4_K", (2, 256), rope_heads=1)
    assert q.quantized and q.row_nbytes == 144 and q.row_order().tolist() == [0, 1]


def test_not_a_regular_file(tmp_path):
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="is not a regular file"):  # and does not block waiting for a writer
        read_gguf(fifo)
    with pytest.raises(CheckpointError, match="is not a regular file"):
        read_gguf(tmp_path)
