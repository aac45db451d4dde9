"""host.memory.available_memory: the room this process may still take, from MemAvailable and the memory cgroups
around it (checked in a real child cgroup where root can make one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.io.residency import ResidencyError, run_in_memory_cgroup
from sluice.host.memory import available_memory

MiB = 2**20


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no MemAvailable in /proc/meminfo")


def test_room_is_at_most_mem_available():
    room = available_memory()
    assert 0 < room.bytes <= _mem_available() + 64 * MiB  # MemAvailable moves between the two reads
    assert room.source


CHILD = ("import json, sluice.host.memory as s; r = s.available_memory(); "
         "print(json.dumps({'bytes': r.bytes, 'source': r.source, 'rooms': s.cgroup_rooms()}))")


def test_a_cgroup_limit_bounds_the_room(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to create a memory cgroup")
    limit = 512 * MiB
    out = tmp_path / "room.json"
    with open(out, "w") as fh:
        try:
            r = run_in_memory_cgroup([sys.executable, "-c", CHILD], limit, timeout=120, stdout=fh,
                                     stderr=subprocess.DEVNULL)
        except ResidencyError as e:
            pytest.skip(f"no writable memory cgroup: {e}")
    assert r.returncode == 0 and not r.oom_killed
    got = json.loads(out.read_text())
    assert "cgroup" in got["source"] and "512.0 MiB" in got["source"]
    # the limit less what the child already holds (python + torch, imported by sluice: well over 50 MiB)
    assert 64 * MiB < got["bytes"] < limit - 50 * MiB, got
