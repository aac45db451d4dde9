"""How much memory this process may still use: the kernel's MemAvailable, and the room left under every memory
cgroup that contains it (a container's limit, a systemd slice, a benchmark ceiling). `--memory auto` sizes the
budget from this, because the box a user has is the limit, not the model's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .cgroup import V1_ROOT, V2_ROOT, chain, own_cgroup, read_keyed, read_value
from ..units import format_bytes

_UNLIMITED = 1 << 60  # v1 reports "no limit" as a page-rounded LONG_MAX


@dataclass(frozen=True)
class MemoryRoom:
    """bytes: the smallest room found; source: what set it, for messages ("MemAvailable", "cgroup /x limit 1 GiB")."""

    bytes: int
    source: str

    @property
    def known(self) -> bool:
        """False when nothing says how much memory there is (bytes is then a huge placeholder)."""
        return self.bytes < _UNLIMITED


def cgroup_rooms() -> list[tuple[int, str]]:
    """(limit - non-reclaimable usage, description) for each limited memory cgroup containing this process.

    Usage counts anonymous memory only (v1 total_rss, v2 anon): page cache under the limit is reclaimed on demand,
    so it is room, not use.
    """
    rooms = []
    if (V2_ROOT / "cgroup.controllers").exists():
        for d in chain(V2_ROOT, own_cgroup("v2")):
            limit = read_value(d / "memory.max")
            if limit is None or not limit.isdigit():
                continue  # "max" (no limit) or no memory controller here
            anon = read_keyed(d / "memory.stat").get("anon", 0)
            rooms.append((int(limit) - anon, f"cgroup {d} limit {format_bytes(int(limit))}"))
    elif (V1_ROOT / "memory.limit_in_bytes").exists():
        for d in [*chain(V1_ROOT, own_cgroup("memory")), V1_ROOT]:
            limit = read_value(d / "memory.limit_in_bytes")
            if limit is None or not limit.isdigit() or int(limit) >= _UNLIMITED:
                continue
            rss = read_keyed(d / "memory.stat").get("total_rss", 0)
            rooms.append((int(limit) - rss, f"cgroup {d} limit {format_bytes(int(limit))}"))
    return rooms


def available_memory() -> MemoryRoom:
    """The memory this process can still take before the kernel reclaims its working set or OOM-kills it."""
    meminfo = read_keyed(Path("/proc/meminfo"))
    candidates = [(meminfo["MemAvailable"] * 1024, "MemAvailable")] if "MemAvailable" in meminfo else []
    candidates += cgroup_rooms()
    if not candidates:  # not Linux, or /proc hidden: no basis for a guess
        return MemoryRoom(_UNLIMITED, "unknown (no /proc/meminfo, no memory cgroup)")
    room, source = min(candidates)
    return MemoryRoom(max(0, room), source)


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_BLOCK_MAX = 32 << 20  # glibc's largest mmap threshold on 64-bit: blocks above it are always fresh mappings


def keep_heap(nbytes: int) -> bool:
    """Let glibc's heap serve the blocks of a prefill (up to HEAP_BLOCK_MAX each) and keep up to `nbytes` free at its
    top instead of returning it to the kernel after each layer; the engine passes what the plan gives one prefill
    chunk's activations (LoadPlan.prefill_bytes), which the memory plan already counts as taken. Otherwise glibc's
    default (blocks over its sliding mmap threshold get their own mapping; the heap is trimmed above twice that)
    returns and refaults them layer after layer. A 2,048-token prompt of the peers bf16 file, resident, medians of 3
    alternated processes (`benchmarks/prefill/faults.py [--glibc-default]`, a removed script: its command is in
    benchmarks/results/prefill/README.md): first prompt 99k -> 34k minor faults, 2,400 -> 2,340 ms; later prompts
    ~80k -> 8.5k faults, ~2,400 -> ~2,300 ms. Process-wide, like the thread count; False where the C library has no
    mallopt (not glibc)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    keep = max(0, min(int(nbytes), (1 << 31) - 1))
    return bool(mallopt(_M_MMAP_THRESHOLD, min(HEAP_BLOCK_MAX, keep)) and mallopt(_M_TRIM_THRESHOLD, keep))


_MADV_DONTNEED = 4  # Linux's, as mmap.MADV_DONTNEED


def _madvise():
    """libc's madvise(addr, length, advice) through ctypes (a call releases the GIL), or None without one."""
    import ctypes

    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def release_pages(addr: int, nbytes: int) -> int:
    """Give the whole pages of [addr, addr + nbytes) of a private anonymous mapping back to the kernel
    (madvise(MADV_DONTNEED)): they leave the process's RSS and its cgroup's charge, and read back as zeros when
    next touched. Returns the bytes released (0 where there is no madvise, or the range holds no whole page)."""
    import mmap

    start = -(-addr // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (addr + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    madvise = _madvise()
    if end <= start or madvise is None or madvise(start, end - start, _MADV_DONTNEED) != 0:
        return 0
    return end - start


_MADV_POPULATE_WRITE = 23  # Linux 5.14+


def populate_pages(t, background: bool = False):
    """Fault in the pages of tensor t (contiguous) for writing, in the kernel (madvise(MADV_POPULATE_WRITE): no
    user-space pass over the bytes, and bytes already written are left as they are); t.fill_(0) where the kernel is
    older (Linux < 5.14). Pages released by release_pages then cost their faults here, not inside a later timed
    step. `background`: where the kernel populates them, all but the first page in a thread (ctypes releases the
    GIL), so the caller goes on meanwhile (writes into the range are safe: populating keeps their bytes); returns
    that thread, to join before the pages are released again, else None."""
    import mmap
    import threading

    nbytes = t.numel() * t.element_size()
    if not nbytes:
        return None
    madvise = _madvise()
    start = t.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    length = t.data_ptr() + nbytes - start
    first = min(length, mmap.PAGESIZE)
    if madvise is None or madvise(start, first, _MADV_POPULATE_WRITE) != 0:
        t.fill_(0)
        return None
    if length == first:
        return None
    if not background:
        madvise(start + first, length - first, _MADV_POPULATE_WRITE)
        return None
    thread = threading.Thread(target=madvise, args=(start + first, length - first, _MADV_POPULATE_WRITE),
                              name="sluice-populate", daemon=True)
    thread.start()
    return thread


def trim_heap() -> bool:
    """Return every free page of glibc's heaps to the kernel (malloc_trim(0)): after a prompt whose passes grew into
    borrowed memory (store/budget.py PromptLoan), so the memory it lent can be taken back. False where the C library
    has no malloc_trim (not glibc)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
