"""Fixtures the I/O tests share."""

from __future__ import annotations

import mmap
import random

import pytest


@pytest.fixture
def random_file(tmp_path):
    """make(size, seed) -> (path, its bytes): a file of seeded random bytes under tmp_path."""

    def make(size: int, seed: int) -> tuple[str, bytes]:
        data = random.Random(seed).randbytes(size)
        path = tmp_path / "model.bin"
        path.write_bytes(data)
        return str(path), data

    return make


@pytest.fixture
def page_buffer():
    """make(nbytes) -> a writable view of a fresh anonymous mapping (page-aligned, zeroed), released after the test:
    destinations to cut at chosen residues."""
    views = []

    def make(nbytes: int) -> memoryview:
        views.append(memoryview(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)))
        return views[-1]

    yield make
    for v in views:
        v.release()
