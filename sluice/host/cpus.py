"""How many CPUs this process may use: its affinity mask, capped by a cgroup CPU quota."""

from __future__ import annotations

import math
import os
from pathlib import Path

from .cgroup import V2_ROOT, chain, own_cgroup, read_value

def _cpu_quota(root: Path, own: str, v2: bool) -> float | None:
    """The tightest CPU bandwidth limit (in CPUs) of this process's cgroup chain, None when unlimited."""
    best = None
    for d in chain(root, own):
        if v2:
            quota, _, period = (read_value(d / "cpu.max") or "max").partition(" ")
        else:
            quota, period = read_value(d / "cpu.cfs_quota_us") or "-1", read_value(d / "cpu.cfs_period_us") or ""
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
