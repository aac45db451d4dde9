"""Byte ranges and the read plan: sort, dedupe, coalesce (and split) requests before any reader touches a file.

A request is `(ReadRange, destination)`; a destination is a writable 1-D uint8 torch tensor (or any writable
buffer, e.g. a memoryview) of exactly `nbytes`. `plan_reads` turns a batch of requests into `Read`s: one
contiguous window of one file each, with the destinations it fills. Readers execute the plan; the plan itself does
no I/O, so it is tested without files.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Union

import torch

Dest = Union[torch.Tensor, memoryview, bytearray]

PAGE = 4096

# Gaps up to 64 KiB between two ranges of one file are read through rather than split into two reads: a random read
# costs ~35-60 us here, which is ~45-70 KiB of sequential transfer at ~1.2 GB/s, so reading the gap is no slower
# and saves one syscall (and ~10 us of Python per read).
DEFAULT_MAX_GAP = 64 * 1024
# One read never grows past 8 MiB by coalescing, and larger ranges are cut into pieces of at most this size, so
# per-worker staging stays small and a batch can be spread over workers; 8 MiB is also the kernel's largest mmap
# readahead here, past which one bigger request bought nothing in `benchmarks/knobs.py workers`.
DEFAULT_MAX_READ = 8 * 1024 * 1024
# Pieces are not cut below 1 MiB when splitting a batch for `parts` workers: each piece is a task for a worker
# thread (queue handoff, GIL, ~40 us per read), and the streaming store submits one batch per expert. On a 3 MiB
# expert, 16 layers x 7 misses per token, cutting to 384 KiB pieces (8 per expert) cost 674 ms CPU per step and
# 483 ms wall; 1.5 MiB pieces 463 ms CPU and 365 ms wall (`sluice bench benchmarks/models/qwen3_moe-peers --cold
# --ceiling 1GiB`, odirect arm, one run per split; the disk is as fast at 768 KiB and up).
MIN_SPLIT = 1024 * 1024
# preadv takes at most IOV_MAX (1024 on Linux) buffers; each segment may add a gap buffer, so 2 per segment.
MAX_SEGMENTS = 500


@dataclass(frozen=True)
class ReadRange:
    """`nbytes` bytes of file `path` starting at ABSOLUTE byte `offset`."""

    path: str
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass
class Segment:
    """One unique range inside a Read: `rel` bytes from the window start, `nbytes` long, copied into every dest.

    dests[0] is the primary (read into directly when the window allows it); dests[1:] are duplicate requests,
    filled by copying from the primary.
    """

    rel: int
    nbytes: int
    dests: list[memoryview]


@dataclass
class Read:
    """One contiguous window of one file (`offset`, `nbytes`) and the segments it fills, sorted by `rel`."""

    path: str
    offset: int
    nbytes: int
    segments: list[Segment] = field(default_factory=list)
    overlapping: bool = False  # some segments share bytes: read into staging, then scatter

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def iovecs(self, gap: memoryview) -> list[memoryview] | None:
        """Buffers for one `os.preadv` over the whole window (zero-copy), or None when segments overlap.

        Gaps between segments are read into slices of `gap` (scratch of at least `max_gap` bytes, contents
        discarded). Duplicate destinations are filled afterwards by `copy_duplicates`.
        """
        if self.overlapping:
            return None
        bufs: list[memoryview] = []
        pos = 0
        for seg in self.segments:
            if seg.rel > pos:
                bufs.append(gap[: seg.rel - pos])
            bufs.append(seg.dests[0])
            pos = seg.rel + seg.nbytes
        return bufs

    def copy_duplicates(self) -> None:
        """After the primaries were filled: copy each primary into its duplicate destinations."""
        for seg in self.segments:
            for d in seg.dests[1:]:
                copy_bytes(d, seg.dests[0])

    def scatter(self, staging: memoryview) -> None:
        """Copy a window read into `staging[:nbytes]` to every destination (primaries and duplicates)."""
        for seg in self.segments:
            src = staging[seg.rel : seg.rel + seg.nbytes]
            for d in seg.dests:
                copy_bytes(d, src)


# Copies of at least this many bytes run without the GIL (ctypes.memmove). A memoryview assignment holds the GIL for
# the whole memcpy (a 3 MiB expert part: 0.05 ms from the cache here, several times that cold out of an O_DIRECT
# staging buffer), during which the main thread cannot dispatch its next torch op. Below it the ~2 us of ctypes
# set-up costs more than it frees.
GIL_FREE_COPY = 64 * 1024


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """dst[:] = src (equal lengths, writable byte views), large copies with the GIL released."""
    n = len(src)
    if n < GIL_FREE_COPY or dst.readonly or src.readonly:
        dst[:] = src
        return
    if len(dst) != n:
        raise ValueError(f"copy of {n} bytes into a {len(dst)}-byte destination")
    ctypes.memmove(address(dst), address(src), n)


def address(buf: memoryview) -> int:
    """The address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


@dataclass
class ReadPlan:
    """What one batch costs: the reads to issue and the counters readers report in stats()."""

    reads: list[Read]
    requests: int  # non-empty requests in the batch
    bytes_requested: int  # sum of all destinations' nbytes
    dedup_saved_bytes: int  # bytes not read again because an identical range was requested
    coalesced: int  # unique ranges that joined an earlier read instead of costing their own

    @property
    def bytes_read(self) -> int:
        """Bytes the file reads cover (unique ranges plus gaps read through)."""
        return sum(r.nbytes for r in self.reads)

    def paths(self) -> list[str]:
        """Distinct files the plan touches, in order."""
        return list(dict.fromkeys(r.path for r in self.reads))

    @property
    def counts(self) -> tuple[int, int, int, int, int, int]:
        """What a reader's counters add for it (io/base.py Counters.add_counts): requests, bytes_requested,
        bytes_read, reads, coalesced, dedup_saved_bytes."""
        return (self.requests, self.bytes_requested, self.bytes_read, len(self.reads), self.coalesced,
                self.dedup_saved_bytes)


def as_buffer(dest: Dest, nbytes: int) -> memoryview:
    """A writable 1-D byte memoryview over `dest` (no copy); ValueError when it is not exactly `nbytes` bytes."""
    if isinstance(dest, torch.Tensor):
        if dest.dtype != torch.uint8 or dest.dim() != 1 or not dest.is_contiguous() or dest.device.type != "cpu":
            raise ValueError(
                f"destination must be a contiguous 1-D uint8 CPU tensor, got {dest.dtype} {tuple(dest.shape)} "
                f"on {dest.device}"
            )
        mv = memoryview(dest.numpy())
    else:
        mv = memoryview(dest)
        if mv.readonly:
            raise ValueError("destination buffer is read-only")
        if not mv.c_contiguous:
            raise ValueError("destination buffer must be contiguous")
    mv = mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv
    if mv.nbytes != nbytes:
        raise ValueError(f"destination holds {mv.nbytes} bytes, the range needs {nbytes}")
    return mv


def page_window(offset: int, nbytes: int, file_size: int, page: int = PAGE) -> tuple[int, int]:
    """(start, length) covering [offset, offset+nbytes): start rounded DOWN to `page`, end rounded UP, clamped.

    The end is clamped to `file_size`, so length may not be a page multiple at EOF. Returns (start, 0) when nothing
    of the range lies inside the file.
    """
    start = (offset // page) * page
    end = min(-(-(offset + nbytes) // page) * page, file_size)
    return start, max(0, end - start)


def plan_reads(
    requests: Sequence[tuple[ReadRange, Dest]],
    *,
    max_gap: int = DEFAULT_MAX_GAP,
    max_read: int = DEFAULT_MAX_READ,
    parts: int = 1,
) -> ReadPlan:
    """Sort by (path, offset), read identical ranges once, coalesce neighbours, and cut big ranges.

    - identical (path, offset, nbytes) requests become one segment with several destinations;
    - ranges of one file closer than `max_gap` bytes (or overlapping) join one Read, up to `max_read` bytes and
      MAX_SEGMENTS segments;
    - with `parts` > 1 (workers), the read size is also capped near bytes/parts (not below MIN_SPLIT) and ranges
      bigger than the cap are cut at page-aligned absolute offsets, so `split_even` can spread them.
    Zero-length requests are dropped. ValueError for a negative offset/length or a destination of the wrong size.
    """
    unique: dict[tuple[str, int, int], list[memoryview]] = {}
    n_requests = 0
    bytes_requested = 0
    dedup_saved = 0
    for rng, dest in requests:
        if rng.offset < 0 or rng.nbytes < 0:
            raise ValueError(f"bad range {rng}: offset and nbytes must be >= 0")
        buf = as_buffer(dest, rng.nbytes)
        if rng.nbytes == 0:
            continue
        n_requests += 1
        bytes_requested += rng.nbytes
        key = (rng.path, rng.offset, rng.nbytes)
        if key in unique:
            unique[key].append(buf)
            dedup_saved += rng.nbytes
        else:
            unique[key] = [buf]

    if parts > 1 and unique:
        share = math.ceil(sum(k[2] for k in unique) / parts)
        max_read = min(max_read, max(MIN_SPLIT, -(-share // PAGE) * PAGE))

    # Cut ranges longer than max_read at absolute multiples of max_read (page-aligned when max_read is), so pieces
    # of one range never share a page under O_DIRECT.
    pieces: list[tuple[str, int, int, list[memoryview]]] = []
    for (path, offset, nbytes), dests in unique.items():
        if nbytes <= max_read:
            pieces.append((path, offset, nbytes, dests))
            continue
        pos, end = offset, offset + nbytes
        while pos < end:
            cut = min(end, (pos // max_read + 1) * max_read)
            a, b = pos - offset, cut - offset
            pieces.append((path, pos, cut - pos, [d[a:b] for d in dests]))
            pos = cut
    pieces.sort(key=lambda p: (p[0], p[1], p[2]))

    reads: list[Read] = []
    coalesced = 0
    cur: Read | None = None
    for path, offset, nbytes, dests in pieces:
        end = offset + nbytes
        if (
            cur is not None
            and cur.path == path
            and offset <= cur.end + max_gap
            and max(end, cur.end) - cur.offset <= max_read
            and len(cur.segments) < MAX_SEGMENTS
        ):
            if offset < cur.end:
                cur.overlapping = True
            cur.segments.append(Segment(offset - cur.offset, nbytes, dests))
            cur.nbytes = max(end, cur.end) - cur.offset
            coalesced += 1
        else:
            cur = Read(path, offset, nbytes, [Segment(0, nbytes, dests)])
            reads.append(cur)
    return ReadPlan(reads, n_requests, bytes_requested, dedup_saved, coalesced)


def split_even(reads: Sequence[Read], parts: int) -> list[list[Read]]:
    """Cut the sorted reads into at most `parts` contiguous chunks of roughly equal bytes (empty chunks dropped)."""
    if parts <= 1 or len(reads) <= 1:
        return [list(reads)] if reads else []
    total = sum(r.nbytes for r in reads)
    chunks: list[list[Read]] = []
    cur: list[Read] = []
    done = 0
    for r in reads:
        cur.append(r)
        done += r.nbytes
        # close the chunk once it reaches its share of the bytes: boundary k at k*total/parts
        if done * parts >= (len(chunks) + 1) * total and len(chunks) < parts - 1:
            chunks.append(cur)
            cur = []
    if cur:
        chunks.append(cur)
    return chunks
