"""What the kernel says about this process: bytes it made the disk deliver, faults, and its memory."""

from __future__ import annotations

import resource


def disk_read_bytes() -> int:
    """Bytes this process (all its threads) made the block layer fetch, from /proc/self/io; 0 where unreadable."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def counters() -> tuple[int, int, int]:
    """(major faults, minor faults, disk bytes read) of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_majflt, r.ru_minflt, disk_read_bytes()


def memory_status() -> dict[str, int]:
    """Peak RSS (VmHWM), anonymous and file-backed RSS now, in bytes, from /proc/self/status.

    VmHWM rather than getrusage's ru_maxrss: after fork+exec, ru_maxrss keeps the parent's peak (a forked child of
    a big harness would report the harness's RSS). File-backed pages are mapped model bytes (mmap/willneed
    readers): page cache the kernel may reclaim, unlike the anonymous part.
    """
    keys = {"VmHWM:": "peak_rss_bytes", "RssAnon:": "rss_anon_bytes", "RssFile:": "rss_file_bytes"}
    out = dict.fromkeys(keys.values(), 0)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":")[0] + ":"
                if key in keys:
                    out[keys[key]] = int(line.split()[1]) * 1024
    except OSError:
        out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out
