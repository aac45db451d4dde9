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


def _engines() -> list:
    """The direct reader's engines: preader.c's threads, its io_uring thread (skipped, saying why, where this kernel
    or a seccomp filter refuses io_uring), the Python threads."""
    from sluice.io import native_pool

    why = native_pool.uring_error()
    return ["native", pytest.param("uring", marks=pytest.mark.skipif(why is not None, reason=str(why))), "python"]


def pytest_generate_tests(metafunc):
    """A test (or a fixture it uses) that takes `io_engine` runs once per engine."""
    if "io_engine" in metafunc.fixturenames:
        metafunc.parametrize("io_engine", _engines())
