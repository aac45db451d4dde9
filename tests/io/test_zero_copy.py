"""O_DIRECT reads land straight in destinations that sit at their file offset modulo the file's O_DIRECT alignment
(512 to 4096 bytes, probed when the file is opened: io/odirect.py odirect_align, direct_iovecs): only the partial
blocks at a range's ends go through staging, and the bytes are the file's either way.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

from sluice.errors import CheckpointError
from sluice.io import DirectReader, odirect
from sluice.io.ranges import PAGE, ReadRange

SIZE = 64 * PAGE + 1234  # not a page multiple: the last window ends short at EOF


@pytest.fixture
def data_file(random_file):
    return random_file(SIZE, 7)


@pytest.fixture
def arena(page_buffer):
    """A page-aligned byte buffer to cut destinations from at chosen residues."""
    return page_buffer(80 * PAGE)


ENGINE = {"name": "auto"}  # set by the `engine` fixture: every test here runs on each engine (conftest io_engine)


@pytest.fixture(autouse=True)
def engine(io_engine):
    ENGINE["name"] = io_engine
    yield io_engine
    ENGINE["name"] = "auto"


def odirect_reader(workers: int = 1) -> DirectReader:
    return DirectReader(workers, odirect=True, engine=ENGINE["name"])


def staged(offset: int, nbytes: int, align: int = PAGE) -> int:
    """Bytes of [offset, offset + nbytes) outside its whole `align` blocks: what a destination in place still
    copies."""
    a, b = -(-offset // align) * align, (offset + nbytes) // align * align
    return nbytes - (b - a) if b > a else nbytes


def _read(path: str, ranges: list[tuple[int, int]], dests: list[memoryview], workers: int = 1) -> dict:
    """The reader's stats, plus "align": the file's O_DIRECT alignment."""
    with odirect_reader(workers) as r:
        r.read([(ReadRange(path, o, n), d) for (o, n), d in zip(ranges, dests)])
        st = {**r.stats(), "align": r.alignment([path])}
    if st["odirect_fallback"]:
        pytest.skip("this filesystem refuses O_DIRECT")
    return st


@pytest.mark.parametrize("offset,nbytes", [(1184, 10 * PAGE), (1184, 10 * PAGE + 500), (0, 8 * PAGE),
                                           (PAGE - 32, 3 * PAGE), (17, 2 * PAGE)])
def test_aligned_destination_copies_only_partial_pages(data_file, arena, offset, nbytes):
    path, data = data_file
    at = PAGE + offset % PAGE  # the destination's address agrees with the file offset modulo the page
    st = _read(path, [(offset, nbytes)], [arena[at : at + nbytes]])
    assert bytes(arena[at : at + nbytes]) == data[offset : offset + nbytes]
    assert st["copied_bytes"] == staged(offset, nbytes, st["align"]) < nbytes  # its whole blocks came by DMA


def test_destination_at_the_block_residue(data_file, arena):
    """A destination that agrees with its file offset modulo the file's alignment, not modulo the page, lands in
    place where the disk takes reads of fewer than 4096 bytes (this VM's virtio disk: 512)."""
    path, data = data_file
    offset, nbytes = 1184, 10 * PAGE
    with odirect_reader() as r:
        align = r.alignment([path])
    if not align or align == PAGE:
        pytest.skip(f"this file's O_DIRECT alignment is {align or 'none (buffered)'}: no residue below the page")
    at = PAGE + (offset + align) % PAGE  # off by one block from the page residue
    st = _read(path, [(offset, nbytes)], [arena[at : at + nbytes]])
    assert bytes(arena[at : at + nbytes]) == data[offset : offset + nbytes]
    assert st["copied_bytes"] == staged(offset, nbytes, align) < 2 * align  # the partial blocks at its ends


@pytest.mark.parametrize("refused,want", [((512, 1024), 2048), ((512, 1024, 2048, 4096), 0), ((), 512)])
def test_alignment_probe(data_file, monkeypatch, refused, want):
    """odirect_align: the smallest block whose reads the file accepts (a read at an offset and an address aligned to
    it and to no more), 0 when none is (read buffered instead)."""
    path, _ = data_file
    real = os.preadv

    def preadv(fd, bufs, offset):
        if len(bufs[0]) in refused:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, offset)

    fd = os.open(path, os.O_RDONLY)  # buffered: the fake refuses by size, the real read always works
    try:
        monkeypatch.setattr(odirect.os, "preadv", preadv)
        assert odirect.odirect_align(fd) == want
    finally:
        monkeypatch.undo()
        os.close(fd)


def test_misaligned_destination_is_staged(data_file, arena):
    path, data = data_file
    offset, nbytes = 1184, 10 * PAGE
    at = PAGE + 1184 + 64  # off by 64 bytes: no page of it can be read in place
    st = _read(path, [(offset, nbytes)], [arena[at : at + nbytes]])
    assert bytes(arena[at : at + nbytes]) == data[offset : offset + nbytes]
    assert st["copied_bytes"] == nbytes


def test_coalesced_neighbours_duplicates_and_eof(data_file, arena):
    """Adjacent ranges in one window (each to its own aligned destination), a duplicate, a misaligned one in the
    same window, and a range ending at EOF: every destination gets the file's bytes."""
    path, data = data_file
    r = 3296
    ranges = [(r + 2 * PAGE * k, 2 * PAGE) for k in range(4)]  # back to back, one window
    dests = [arena[(1 + 3 * k) * PAGE + r : (1 + 3 * k) * PAGE + r + 2 * PAGE] for k in range(4)]
    ranges.append(ranges[1])  # duplicate of the second: copied from its primary
    dests.append(arena[14 * PAGE + r : 14 * PAGE + r + 2 * PAGE])
    ranges.append((r + 8 * PAGE, 5000))  # the next range in the window, misaligned destination
    dests.append(arena[20 * PAGE + 7 : 20 * PAGE + 7 + 5000])
    tail = (SIZE - 3 * PAGE - 100, 3 * PAGE + 100)  # ends at EOF, inside the last (short) page
    ranges.append(tail)
    at = 30 * PAGE + tail[0] % PAGE
    dests.append(arena[at : at + tail[1]])
    st = _read(path, ranges, dests, workers=2)
    for (o, n), d in zip(ranges, dests):
        assert bytes(d) == data[o : o + n], (o, n)
    al = st["align"]
    want = sum(staged(o, n, al) for o, n in ranges[:4] + ranges[6:]) + 2 * PAGE + 5000  # + the duplicate, misaligned
    assert st["copied_bytes"] == want < sum(n for _, n in ranges)


def test_torch_slot_rows(data_file):
    """The streaming store's case: rows of a page-aligned tensor, each range at its residue inside the row."""
    path, data = data_file
    from sluice.store.pages import page_rows as _page_rows

    rows = _page_rows(3, 12 * PAGE)
    ranges = [(1184 + k * 10 * PAGE, 9 * PAGE) for k in range(3)]
    dests = [rows[k, 1184 : 1184 + 9 * PAGE] for k in range(3)]
    with odirect_reader(3) as rd:
        rd.read([(ReadRange(path, o, n), d) for (o, n), d in zip(ranges, dests)])
        st, al = rd.stats(), rd.alignment([path])
    for (o, n), d in zip(ranges, dests):
        assert d.numpy().tobytes() == data[o : o + n]
    if not st["odirect_fallback"]:
        assert st["copied_bytes"] == sum(staged(o, n, al) for o, n in ranges)


def test_truncated_file_is_a_checkpoint_error(data_file, arena, tmp_path):
    path, data = data_file
    with open(path, "r+b") as f:
        f.truncate(20 * PAGE)
    at = PAGE + 1184
    with odirect_reader() as r:
        with pytest.raises(CheckpointError, match=f"file has {20 * PAGE} bytes"):
            r.read([(ReadRange(path, 1184 + 15 * PAGE, 10 * PAGE), arena[at : at + 10 * PAGE])])
