"""How much memory this process may still use: the kernel's MemAvailable, and the room left under every memory
cgroup that contains it (a container's limit, a systemd slice, a benchmark ceiling). `--memory auto` sizes the
budget from this, because the box a user has is the limit, not the model's size.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from .io.residency import V1_ROOT, V2_ROOT, own_cgroup, read_keyed
from .options import format_bytes

_UNLIMITED = 1 << 60  # v1 reports "no limit" as a page-rounded LONG_MAX


@dataclass(frozen=True)
class MemoryRoom:
    """bytes: the smallest room found; source: what set it, for messages ("MemAvailable", "cgroup /x limit 1 GiB")."""

    bytes: int
    source: str


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _chain(root: Path, own: str) -> list[Path]:
    """Our cgroup directory and its ancestors below `root`, innermost first (the ones visible here)."""
    d = root / own.lstrip("/")
    out = []
    while d != root and root in d.parents:
        if d.is_dir():
            out.append(d)
        d = d.parent
    return out


def cgroup_rooms() -> list[tuple[int, str]]:
    """(limit - non-reclaimable usage, description) for each limited memory cgroup containing this process.

    Usage counts anonymous memory only (v1 total_rss, v2 anon): page cache under the limit is reclaimed on demand,
    so it is room, not use.
    """
    rooms = []
    if (V2_ROOT / "cgroup.controllers").exists():
        for d in _chain(V2_ROOT, own_cgroup("v2")):
            limit = _read(d / "memory.max")
            if limit is None or not limit.isdigit():
                continue  # "max" (no limit) or no memory controller here
            anon = read_keyed(d / "memory.stat").get("anon", 0)
            rooms.append((int(limit) - anon, f"cgroup {d} limit {format_bytes(int(limit))}"))
    elif (V1_ROOT / "memory.limit_in_bytes").exists():
        for d in [*_chain(V1_ROOT, own_cgroup("memory")), V1_ROOT]:
            limit = _read(d / "memory.limit_in_bytes")
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


def _cpu_quota(root: Path, own: str, v2: bool) -> float | None:
    """The tightest CPU bandwidth limit (in CPUs) of this process's cgroup chain, None when unlimited."""
    best = None
    for d in _chain(root, own):
        if v2:
            quota, _, period = (_read(d / "cpu.max") or "max").partition(" ")
        else:
            quota, period = _read(d / "cpu.cfs_quota_us") or "-1", _read(d / "cpu.cfs_period_us") or ""
        if quota.isdigit() and period.isdigit() and int(period) > 0:
            cpus = int(quota) / int(period)
            best = cpus if best is None else min(best, cpus)
    return best


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (taskset, cpuset), capped by a cgroup CPU quota (a
    container's `--cpus`). torch's default is every CPU of the host, and in a container with a 2-CPU quota on a
    64-core host 64 spinning threads share 2 CPUs' worth of time: each parallel region waits for descheduled
    threads."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    if (V2_ROOT / "cgroup.controllers").exists():
        quota = _cpu_quota(V2_ROOT, own_cgroup("v2"), v2=True)
    else:
        quota = _cpu_quota(V2_ROOT / "cpu", own_cgroup("cpu"), v2=False)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)
