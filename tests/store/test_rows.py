"""RowTable gathers are bitwise equal to indexing the full table, in every mode, for every awkward id batch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sluice.checkpoint import read_header, write_safetensors
from sluice.errors import CheckpointError
from sluice.io import DirectReader, MmapReader, WillneedReader, make_reader
from sluice.store.rows import RowTable

# mode of the RowTable, and how to make the reader it is given (None: the table makes its own)
CASES = {
    "resident": ("resident", None),
    "mmap": ("mmap", lambda: make_reader("mmap")),
    "mmap-own": ("mmap", None),
    "willneed": ("mmap", lambda: make_reader("willneed")),
    "direct": ("direct", lambda: make_reader("direct", workers=2, odirect=False)),
    "direct-odirect": ("direct", lambda: make_reader("direct", workers=2, odirect=True)),
    "direct-own": ("direct", None),
}


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape and raw(got) == raw(want)


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """A safetensors file whose two tables start at unaligned offsets; the full tables and their refs."""
    g = torch.Generator().manual_seed(0)
    full = {
        "pad": torch.arange(3, dtype=torch.uint8),  # 3 bytes first: every table after it starts off alignment
        "embed": torch.randn(1000, 48, generator=g).to(torch.bfloat16),  # 96-byte rows
        "pad2": torch.arange(7, dtype=torch.int8),
        "small": torch.randn(37, 5, generator=g),  # float32, 20-byte rows
    }
    path = tmp_path_factory.mktemp("rows") / "t.safetensors"
    write_safetensors(path, full)
    refs, _ = read_header(path)
    assert refs["embed"].offset % 8 and refs["small"].offset % 4  # the point of the padding
    return full, refs


@pytest.fixture(params=list(CASES))
def case(request):
    mode, make = CASES[request.param]
    reader = make() if make else None
    yield mode, reader
    if reader is not None:
        reader.close()


def id_batches(rows: int, seed: int) -> list[torch.Tensor | list[int]]:
    g = torch.Generator().manual_seed(seed)
    batches: list[torch.Tensor | list[int]] = [
        torch.randint(0, rows, (n,), generator=g) for n in (1, 5, 64, 300)  # random, duplicates likely
    ]
    batches += [
        torch.tensor([rows // 2] * 4 + [0, rows - 1, 0]),  # heavy duplicates, both ends
        [3 % rows],  # a single id, as a list
        torch.tensor(rows - 1),  # a 0-d id -> [cols]
        torch.arange(rows),  # every row: adjacent rows coalesce
        torch.arange(rows - 1, -1, -1),  # descending
        torch.randint(0, rows, (4, 6), generator=g, dtype=torch.int32),  # 2-D, int32
        torch.empty(0, dtype=torch.long),
    ]
    return batches


@pytest.mark.parametrize("name", ["embed", "small"])
def test_gather_equals_full_indexing(tables, case, name):
    full, refs = tables
    mode, reader = case
    table = full[name]
    with RowTable(refs[name], mode, reader, staging_rows=2) as rt:  # tiny staging: growth is exercised
        for ids in id_batches(table.shape[0], seed=len(name)):
            same(rt.gather(ids), table[torch.as_tensor(ids, dtype=torch.long)])


@pytest.mark.parametrize("name", ["embed", "small"])
def test_convert_to_float32(tables, case, name):
    full, refs = tables
    mode, reader = case
    with RowTable(refs[name], mode, reader, dtype=torch.float32) as rt:
        ids = torch.tensor([5, 0, 5, 36, 1, 36])
        same(rt.gather(ids), full[name][ids].to(torch.float32))


def test_bad_ids(tables, case):
    full, refs = tables
    mode, reader = case
    with RowTable(refs["embed"], mode, reader) as rt:
        for bad in (1000, -1, 10**12):
            with pytest.raises(IndexError, match=rf"'embed'.*id {bad} is out of range \[0, 1000\)"):
                rt.gather(torch.tensor([1, 2, bad, 3]))
        with pytest.raises(IndexError, match="id -5"):
            rt.gather([0, -5])
        with pytest.raises(TypeError, match="integers"):
            rt.gather(torch.tensor([1.0]))
        with pytest.raises(TypeError, match="integers"):
            rt.gather(torch.tensor([True, False]))
        assert rt.stats()["rows_requested"] == 0  # a rejected batch counts nothing


def test_counters_count_distinct_rows(tables, case):
    full, refs = tables
    mode, reader = case
    row_bytes = 48 * 2
    with RowTable(refs["embed"], mode, reader, staging_rows=4) as rt:
        rt.gather(torch.tensor([7, 7, 3, 7, 3, 999]))
        rt.gather([1])
        s = rt.stats()
        assert s["rows_requested"] == 7 and s["gathers"] == 2 and s["rows_distinct"] == 4
        assert s["wait_s"] >= 0 and (s["wait_s"] == 0) == (mode == "resident")
        if mode == "resident":
            assert s["rows_read"] == 1000 and s["bytes_read"] == refs["embed"].nbytes
            assert s["nbytes_resident"] == refs["embed"].nbytes
        else:
            assert s["rows_read"] == 4 and s["bytes_read"] == 4 * row_bytes
            assert s["nbytes_resident"] == 4 * row_bytes  # staging of 4 rows was enough: not grown
            before = reader.stats()["reads"] if reader is not None else 0
            rt.gather(torch.arange(10))
            assert rt.nbytes_resident == 10 * row_bytes  # grown to fit the batch (2x4 < 10)
            rt.gather(torch.arange(9, -1, -1))
            assert rt.nbytes_resident == 10 * row_bytes  # reused, not reallocated
            assert rt.stats()["rows_read"] == 24
            if reader is not None:
                # 10 adjacent rows, one ReadRange each: the reader coalesced them into ONE file read per batch
                assert reader.stats()["reads"] - before == 2


def test_staging_never_exceeds_table(tables):
    _, refs = tables
    with RowTable(refs["small"], "direct", staging_rows=1000) as rt:
        assert rt.nbytes_resident == 37 * 20
        rt.gather(torch.arange(37).repeat(3))
        assert rt.nbytes_resident == 37 * 20


def test_output_is_not_staging(tables, case):
    """A gather's result survives the next gather (it never aliases the reused staging)."""
    full, refs = tables
    mode, reader = case
    with RowTable(refs["embed"], mode, reader) as rt:
        a = rt.gather([1, 2, 3])
        rt.gather([500, 501, 502])
        same(a, full["embed"][[1, 2, 3]])


def test_mode_and_reader_mismatch(tables):
    _, refs = tables
    with pytest.raises(ValueError, match="unknown RowTable mode"):
        RowTable(refs["embed"], "lazy")
    with DirectReader(workers=1) as d, pytest.raises(ValueError, match="'mmap' or 'willneed'"):
        RowTable(refs["embed"], "mmap", d)
    with MmapReader() as m, pytest.raises(ValueError, match="'direct'"):
        RowTable(refs["embed"], "direct", m)
    with WillneedReader() as w:
        RowTable(refs["embed"], "mmap", w).close()  # willneed is a mapping reader: accepted
    with pytest.raises(Exception, match="2-D"):
        RowTable(refs["pad"], "resident")


@pytest.mark.parametrize("mode", ["resident", "mmap", "direct"])
def test_other_dtypes_and_zero_width(tmp_path, mode):
    """Any dtype and row size: 1-byte fp8 and bool rows, 8-byte int64 rows, uint32, and zero-width rows."""
    full = {
        "pad": torch.zeros(1, dtype=torch.uint8),
        "u32": torch.arange(60, dtype=torch.int64).reshape(20, 3).to(torch.uint32),
        "f8": torch.linspace(-4, 4, 140).reshape(20, 7).to(torch.float8_e4m3fn),
        "bool": (torch.arange(100) % 3 == 0).reshape(20, 5),
        "i64": torch.arange(-10, 10).reshape(20, 1),
        "zero": torch.empty(20, 0),
    }
    path = tmp_path / "d.safetensors"
    write_safetensors(path, full)
    refs, _ = read_header(path)
    ids = torch.tensor([3, 19, 3, 0])
    for name, t in full.items():
        if name != "pad":
            with RowTable(refs[name], mode) as rt:
                same(rt.gather(ids), t[ids])


def test_closed_table_and_own_reader(tables):
    _, refs = tables
    rt = RowTable(refs["embed"], "direct")
    own = rt._reader
    rt.close()
    rt.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        rt.gather([1])
    with pytest.raises(RuntimeError, match="closed"):
        own.read([])  # the table closed the pool it made


# -- one logical table in parts (qwen4_exp's n-gram tables: the hub's `...shard_K.weight`) ----------------------------
@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """A [200, 6] bf16 table in four uneven parts (one of a single row) over two files, the first part at an
    unaligned offset; the whole table and the parts' refs in row order."""
    g = torch.Generator().manual_seed(3)
    full = torch.randn(200, 6, generator=g).to(torch.bfloat16)
    d = tmp_path_factory.mktemp("parts")
    write_safetensors(d / "a.safetensors", {"pad": torch.zeros(3, dtype=torch.uint8), "t.shard_0.weight": full[:70],
                                            "t.shard_1.weight": full[70:71]})
    write_safetensors(d / "b.safetensors", {"t.shard_2.weight": full[71:140], "t.shard_3.weight": full[140:]})
    a, _ = read_header(d / "a.safetensors")
    b, _ = read_header(d / "b.safetensors")
    return full, [a["t.shard_0.weight"], a["t.shard_1.weight"], b["t.shard_2.weight"], b["t.shard_3.weight"]]


def test_a_table_in_parts_gathers_as_the_whole_table(parts, case):
    full, refs = parts
    mode, reader = case
    with RowTable(refs, mode, reader, staging_rows=2, name="t") as rt:
        assert (rt.rows, rt.cols, rt.name) == (200, 6, "t")
        for ids in id_batches(200, seed=9) + [torch.tensor([69, 70, 71, 70, 139, 140, 199, 0])]:  # across the cuts
            same(rt.gather(ids), full[torch.as_tensor(ids, dtype=torch.long)])
        with pytest.raises(IndexError, match=r"'t' \[200, 6\] \(4 parts\): id 200"):
            rt.gather([3, 200])


def test_a_table_in_parts_reads_each_distinct_row_once(parts, case):
    full, refs = parts
    mode, reader = case
    with RowTable(refs, mode, reader, name="t") as rt:
        before = reader.stats()["bytes_requested"] if reader is not None else 0
        out = rt.gather(torch.tensor([[70, 3, 70], [199, 3, 71]]))
        same(out, full[torch.tensor([[70, 3, 70], [199, 3, 71]])])
        s = rt.stats()
        assert s["rows_distinct"] == 4 and s["rows_requested"] == 6
        if mode == "resident":
            assert s["rows_read"] == 200 and s["bytes_read"] == 200 * 12 == rt.nbytes_resident
        else:
            assert s["rows_read"] == 4 and s["bytes_read"] == 4 * 12
            if reader is not None:
                assert reader.stats()["bytes_requested"] - before == 4 * 12  # one range per distinct row


def test_parts_must_be_one_table(parts, tmp_path):
    _, refs = parts
    write_safetensors(tmp_path / "c.safetensors", {"wide": torch.zeros(5, 7, dtype=torch.bfloat16),
                                                   "f32": torch.zeros(5, 6)})
    c, _ = read_header(tmp_path / "c.safetensors")
    for bad, what in ((c["wide"], "6 columns of BF16, got 7 of BF16"), (c["f32"], "6 columns of BF16, got 6 of F32")):
        with pytest.raises(CheckpointError, match=what) as e:
            RowTable([*refs, bad], "direct")
        assert bad.name in str(e.value) and "c.safetensors" in str(e.value)
    with pytest.raises(ValueError, match="no parts"):
        RowTable([], "resident")


# -- tables in a ggml block format (a GGUF's quantized n-gram table) -------------------------------------------------
# F16 / BF16 / Q8_0 / Q4_0 / Q5_1 encoded by the gguf package; the K and IQ types (which it cannot encode) as random
# valid blocks: the reference is the gguf package's dequantization of the stored bytes either way
BLOCK_TYPES = ["F16", "BF16", "Q8_0", "Q4_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "IQ4_NL", "IQ2_XS"]


@pytest.fixture(scope="module")
def block_tables(tmp_path_factory):
    """A GGUF of 90 x 256 tables, one per BLOCK_TYPES (the first after an odd-sized tensor), and a Q8_0 table in two
    parts; (refs by name, the reference values by name)."""
    from gguf import GGUFWriter
    from gguf.quants import dequantize

    from sluice.checkpoint.gguf import read_gguf
    from tests.checkpoint.gguf_files import Q, encode

    path = tmp_path_factory.mktemp("blocks") / "t.gguf"
    w = GGUFWriter(path, "test")
    w.add_tensor("pad", np.arange(3, dtype=np.float32))
    values = np.random.default_rng(5).standard_normal((90, 256)).astype(np.float32)
    want = {}
    for name in BLOCK_TYPES + ["part0", "part1"]:
        qtype = Q[name] if name in BLOCK_TYPES else Q.Q8_0
        rows = values[:50] if name == "part0" else values[50:] if name == "part1" else values
        data = encode(rows, qtype, seed=len(want))
        w.add_tensor(name, data, raw_dtype=None if qtype == Q.F16 else qtype)
        want[name] = torch.from_numpy(np.ascontiguousarray(dequantize(data, qtype), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return read_gguf(path).tensors, want


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_a_block_format_table_gathers_its_dequantized_rows(block_tables, case, name):
    refs, want = block_tables
    mode, reader = case
    with RowTable(refs[name], mode, reader, staging_rows=3) as rt:
        assert (rt.rows, rt.cols, rt.row_bytes) == (90, 256, refs[name].row_nbytes)
        assert rt.table_dtype == {"F16": torch.float16, "BF16": torch.bfloat16}.get(name, torch.float32)
        for ids in id_batches(90, seed=4):  # plain types in their own dtype, blocks dequantized to float32
            ids = torch.as_tensor(ids, dtype=torch.long)
            same(rt.gather(ids), want[name][ids].to(rt.table_dtype))
        s = rt.stats()
        if mode != "resident":  # each batch's distinct rows read once, as whole blocks
            assert s["bytes_read"] == s["rows_read"] * refs[name].row_nbytes == s["rows_distinct"] * rt.row_bytes
        else:  # kept in its blocks
            assert rt.nbytes_resident == refs[name].nbytes == 90 * refs[name].row_nbytes
    with RowTable(refs[name], mode, reader, dtype=torch.bfloat16) as rt:
        same(rt.gather([7, 3, 7]), want[name][[7, 3, 7]].to(torch.bfloat16))


def test_a_block_format_table_in_parts(block_tables, case):
    refs, want = block_tables
    mode, reader = case
    full = torch.cat([want["part0"], want["part1"]])
    with RowTable([refs["part0"], refs["part1"]], mode, reader, name="q") as rt:
        ids = torch.tensor([[49, 50, 3], [89, 50, 0]])
        same(rt.gather(ids), full[ids])
        assert rt.stats()["rows_distinct"] == 5


def test_a_block_format_must_be_one_sluice_dequantizes(block_tables):
    refs, _ = block_tables
    for bad, what in ((dataclasses.replace(refs["Q8_0"], dtype="Q8_1", nbytes=90 * 8 * 40), "stored as Q8_1 cannot "
                                                                                        "be read by rows"),
                      (dataclasses.replace(refs["Q8_0"], nbytes=refs["Q8_0"].nbytes - 34), "nbytes"),
                      (dataclasses.replace(refs["Q4_K"], shape=(90, 128)), "whole blocks of 256"),
                      (refs["Q4_K"], "must have its 256 columns of Q8_0, got 256 of Q4_K")):
        parts = [refs["Q8_0"], bad] if bad is refs["Q4_K"] else [bad]
        with pytest.raises(CheckpointError, match=what) as e:
            RowTable(parts, "direct")
        assert bad.name in str(e.value)
