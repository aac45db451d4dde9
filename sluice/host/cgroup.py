"""Where this process sits in the cgroup hierarchies, and the 'key value' files the kernel writes there."""

from __future__ import annotations

from pathlib import Path

V2_ROOT = Path("/sys/fs/cgroup")
V1_ROOT = Path("/sys/fs/cgroup/memory")


def own_cgroup(controller_line: str) -> str:
    """This process's cgroup path: 'v2' for the unified hierarchy, else a v1 controller name ('memory', 'cpu')."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hid, controllers, path = line.split(":", 2)
            if controller_line == "v2" and hid == "0" and controllers == "":
                return path
            if controller_line != "v2" and controller_line in controllers.split(","):
                return path
    except OSError:
        pass
    return "/"


def read_keyed(path: Path) -> dict[str, int]:
    """A file of 'key value' lines (memory.events, memory.stat, memory.oom_control; also /proc/meminfo's
    'Key: value kB') as {key: value}; {} if unreadable."""
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            parts = line.replace(":", " ").split()
            if len(parts) >= 2 and parts[1].isdigit():
                out[parts[0]] = int(parts[1])
    except OSError:
        pass
    return out


def read_value(path: Path) -> str | None:
    """A one-value cgroup file's content, stripped; None when unreadable (no such controller here)."""
    try:
        return path.read_text().strip()
    except OSError:
        return None


def chain(root: Path, own: str) -> list[Path]:
    """Our cgroup directory and its ancestors below `root`, innermost first (the ones visible here)."""
    d = root / own.lstrip("/")
    out = []
    while d != root and root in d.parents:
        if d.is_dir():
            out.append(d)
        d = d.parent
    return out
