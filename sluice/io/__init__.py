"""How bytes move from model files into memory: read plans, three readers with one interface, residency tools.

    reader = make_reader("direct", workers=4)
    reader.read([(ReadRange(path, offset, nbytes), dest_uint8_tensor), ...])   # blocking
    fut = reader.submit(requests); ...; fut.result()                          # prefetch
"""

from __future__ import annotations

from sluice.io.base import Reader, ReadFuture, Request
from sluice.io.direct import DEFAULT_WORKERS, DirectReader
from sluice.io.engines import ROW_WORKERS
from sluice.io.mapped import MmapReader, WillneedReader
from sluice.io.ranges import ReadRange, page_window, plan_reads
from sluice.io.tensor import read_bytes

MODES = ("mmap", "willneed", "direct")


def make_reader(mode: str, workers: int = DEFAULT_WORKERS, odirect: bool = False, engine: str = "auto") -> Reader:
    """A reader for `mode` in MODES. `workers`, `odirect` and `engine` (io/direct.py ENGINES) apply to "direct"
    only."""
    if mode == "mmap":
        return MmapReader()
    if mode == "willneed":
        return WillneedReader()
    if mode == "direct":
        return DirectReader(workers=workers, odirect=odirect, engine=engine)
    raise ValueError(f"unknown I/O mode {mode!r}; choose one of {', '.join(MODES)}")


__all__ = [
    "DEFAULT_WORKERS",
    "MODES",
    "DirectReader",
    "MmapReader",
    "ReadFuture",
    "ReadRange",
    "Reader",
    "Request",
    "WillneedReader",
    "make_reader",
    "page_window",
    "plan_reads",
    "read_bytes",
]
