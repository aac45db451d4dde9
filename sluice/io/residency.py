"""Residency tools: evict a file from the page cache, measure how much of it is cached (mincore), warm it, and run
a child process under a memory ceiling (cgroup v2, else v1).

Cold means verified cold: `evict` then `verify_cold` before a timed run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import mmap
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from sluice.errors import SluiceError
from sluice.host.cgroup import V1_ROOT, V2_ROOT, own_cgroup, read_keyed


class ResidencyError(SluiceError):
    """Residency cannot be measured or controlled here (no cgroup access, a file still cached, ...)."""


def evict(path: str | os.PathLike[str]) -> None:
    """Drop `path`'s pages from the page cache: fdatasync (dirty pages cannot be dropped), then POSIX_FADV_DONTNEED.

    Pages mapped by any process (an open MmapReader, a model loaded with mmap) are NOT dropped: close those
    mappings (munmap) first, or resident_fraction stays high.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MINCORE_CHUNK = 1 << 30  # map 1 GiB at a time: the residency vector is 256 KiB per call


def resident_bytes(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(resident pages * page size, file size) of `path`, by mincore over a PROT_READ mapping (reads nothing)."""
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        resident = 0
        for start in range(0, size, _MINCORE_CHUNK):
            length = min(_MINCORE_CHUNK, size - start)
            addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
            if addr in (None, _MAP_FAILED):
                e = ctypes.get_errno()
                raise ResidencyError(f"mmap of {path} for mincore failed: {os.strerror(e)}")
            try:
                pages = -(-length // page)
                vec = (ctypes.c_ubyte * pages)()
                if _libc.mincore(addr, length, vec) != 0:
                    e = ctypes.get_errno()
                    raise ResidencyError(f"mincore on {path} failed: {os.strerror(e)}")
                resident += int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1)) * page
            finally:
                _libc.munmap(addr, length)
        return min(resident, -(-size // page) * page), size
    finally:
        os.close(fd)


def resident_fraction(path: str | os.PathLike[str]) -> float:
    """Fraction of `path`'s pages in the page cache, 0.0 .. 1.0 (0.0 for an empty file)."""
    resident, size = resident_bytes(path)
    if size == 0:
        return 0.0
    return resident / (-(-size // mmap.PAGESIZE) * mmap.PAGESIZE)


def verify_cold(paths: Iterable[str | os.PathLike[str]], max_fraction: float = 0.01) -> dict[str, float]:
    """Residency of each path; ResidencyError naming the files above `max_fraction` (evict them, close mappings)."""
    fractions = {str(p): resident_fraction(p) for p in paths}
    warm = {p: f for p, f in fractions.items() if f > max_fraction}
    if warm:
        listed = ", ".join(f"{p} ({f:.1%})" for p, f in warm.items())
        memfs = {filesystem_type(p) for p in warm} & MEMORY_FILESYSTEMS
        if memfs:  # eviction cannot work: the file lives in memory
            raise ResidencyError(f"not cold: {listed} resident on {', '.join(sorted(memfs))}, a memory-backed "
                                 "filesystem that cannot be evicted; put the model on a disk")
        raise ResidencyError(f"not cold: {listed} resident; evict them and unmap any open mapping first")
    return fractions


MEMORY_FILESYSTEMS = {"tmpfs", "ramfs"}


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """The type of the filesystem holding `path` ("ext4", "tmpfs", ...; "" if unknown): the longest mount point of
    /proc/mounts that contains it. Residency (page cache, cold runs) means nothing on a memory-backed one."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mnt, fstype, *_ = line.split()
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, fstype
    except OSError:
        pass
    return kind


def warm(path: str | os.PathLike[str], chunk: int = 8 << 20) -> int:
    """Prefault: read `path` sequentially (8 MiB at a time) so it sits in the page cache; returns bytes read."""
    total = 0
    buf = bytearray(chunk)
    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := f.readinto(buf):
            total += n
    return total



# --- memory ceilings --------------------------------------------------------------------------------------------


class CgroupResult(NamedTuple):
    """What running a child under a memory ceiling showed. Unpacks as (returncode, oom_killed, peak_bytes)."""

    returncode: int
    oom_killed: bool
    peak_bytes: int  # high-water mark of the cgroup's memory (v1 max_usage_in_bytes, v2 memory.peak; 0 if unknown)


_counter = itertools.count()


def _pick_cgroup_parent() -> tuple[str, Path, list[str]]:
    """('v2'|'v1', parent directory, what was tried). The child cgroup nests under our own (its limits still
    apply) when that directory is visible here, else under the hierarchy root."""
    tried: list[str] = []
    controllers = V2_ROOT / "cgroup.controllers"
    if controllers.exists():
        if "memory" in controllers.read_text().split():
            own = V2_ROOT / own_cgroup("v2").lstrip("/")
            # v2 "no internal processes": a cgroup holding processes cannot enable controllers for children, so
            # nest under our own cgroup only if memory is already delegated there.
            sub = own / "cgroup.subtree_control"
            if own != V2_ROOT and sub.exists() and "memory" in sub.read_text().split():
                return "v2", own, tried
            return "v2", V2_ROOT, tried
        tried.append(f"{controllers}: no memory controller")
    else:
        tried.append(f"{controllers}: missing (not cgroup v2)")
    if (V1_ROOT / "memory.limit_in_bytes").exists():
        own = V1_ROOT / own_cgroup("memory").lstrip("/")
        return "v1", own if own.is_dir() else V1_ROOT, tried
    tried.append(f"{V1_ROOT}: not mounted")
    raise ResidencyError("no memory cgroup: " + "; ".join(tried))


def _write(path: Path, value: str) -> None:
    path.write_text(value)


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _kill_remaining(cg: Path) -> None:
    """SIGKILL processes the child left in its cgroup (our own descendants), so the cgroup can be removed."""
    for _ in range(50):
        pids = [int(p) for p in (cg / "cgroup.procs").read_text().split()] if cg.exists() else []
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _remove(cg: Path) -> None:
    _kill_remaining(cg)
    for _ in range(50):  # rmdir can see EBUSY while the kernel finishes reaping the last task
        try:
            cg.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)


def run_in_memory_cgroup(
    argv: Sequence[str],
    limit_bytes: int,
    *,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    stdout: int | None = None,
    stderr: int | None = None,
) -> CgroupResult:
    """Run `argv` in a fresh memory cgroup limited to `limit_bytes` (no swap); wait; remove the cgroup.

    The child joins the cgroup before it execs `argv` (via `/bin/sh -c 'echo $$ > cgroup.procs; exec ...'`; this
    avoids Popen's preexec_fn, which can deadlock in a process with threads such as a reader pool), so everything it
    allocates is charged. `oom_killed` comes from the cgroup's oom_kill counter (v2 memory.events, v1
    memory.oom_control), or on old v1 kernels from returncode -9 with a non-zero failcnt. On timeout the child's
    cgroup is killed and subprocess.TimeoutExpired is raised. ResidencyError when no memory cgroup is writable
    (not root, or not mounted), saying what was tried.
    """
    version, parent, tried = _pick_cgroup_parent()
    cg = parent / f"sluice-{os.getpid()}-{next(_counter)}"
    try:
        cg.mkdir()
    except OSError as e:
        tried.append(f"mkdir {cg}: {e.strerror or e}")
        raise ResidencyError(
            "cannot create a memory cgroup (needs root and a writable cgroup mount): " + "; ".join(tried)
        ) from e
    try:
        if version == "v2":
            _write(cg / "memory.max", str(limit_bytes))
            if (cg / "memory.swap.max").exists():
                _write(cg / "memory.swap.max", "0")
        else:
            _write(cg / "memory.limit_in_bytes", str(limit_bytes))
            if (cg / "memory.memsw.limit_in_bytes").exists():  # memory+swap: no escape into swap
                _write(cg / "memory.memsw.limit_in_bytes", str(limit_bytes))
        wrapper = ["/bin/sh", "-c", 'echo $$ > "$0" || exit 125; exec "$@"', str(cg / "cgroup.procs"), *argv]
        proc = subprocess.Popen(wrapper, env=env, cwd=cwd, stdout=stdout, stderr=stderr)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_remaining(cg)
            proc.wait()
            raise
        if version == "v2":
            peak = _read_int(cg / "memory.peak")
            oom = read_keyed(cg / "memory.events").get("oom_kill", 0) > 0
        else:
            peak = _read_int(cg / "memory.max_usage_in_bytes")
            oom_file = cg / "memory.oom_control"
            if "oom_kill " in oom_file.read_text():
                oom = read_keyed(oom_file).get("oom_kill", 0) > 0
            else:  # kernels before 4.13 have no counter
                oom = rc == -signal.SIGKILL and _read_int(cg / "memory.failcnt") > 0
        return CgroupResult(rc, oom, peak)
    except PermissionError as e:
        raise ResidencyError(f"cgroup {cg} is not writable: {e}; run as root") from e
    finally:
        _remove(cg)
