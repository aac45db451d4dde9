"""Fixtures the I/O tests share."""

from __future__ import annotations

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
