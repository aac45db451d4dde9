"""How much memory this process may still use: the kernel's MemAvailable, and the room left under every memory
cgroup that contains it (a container's limit, a systemd slice, a benchmark ceiling). `--memory auto` sizes the
budget from this, because the box a user has is the limit, not the model's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .cgroup import V1_ROOT, V2_ROOT, chain, own_cgroup, read_keyed, read_value
from ..options import format_bytes

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
