"""sysmem.available_memory: the room this process may still take, from MemAvailable and the memory cgroups
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


def _child(code: str, env: dict | None = None, pre: list[str] | None = None) -> str:
    env = {k: v for k, v in (env if env is not None else os.environ).items()}
    return subprocess.run([*(pre or []), sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip()


WAIT = "import os, sluice; print(os.environ.get('OMP_WAIT_POLICY'))"


def test_import_sets_passive_openmp_waiting_unless_the_user_chose():
    """Spinning OpenMP threads made decode 2-8x slower beside one busy process (benchmarks/contention.py)."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    assert _child(WAIT, base) == "PASSIVE"
    assert _child(WAIT, {**base, "OMP_WAIT_POLICY": "active"}) == "active"
    assert _child(WAIT, {**base, "GOMP_SPINCOUNT": "1000"}) == "None"  # the user tuned libgomp: left alone
    # too late once torch is loaded (libgomp read its environment then): not set, rather than set to no effect
    assert _child("import torch, os, sluice; print(os.environ.get('OMP_WAIT_POLICY'))", base) == "None"


def test_usable_cpus_follows_the_affinity_mask():
    code = "from sluice.host.cpus import usable_cpus; print(usable_cpus())"
    assert int(_child(code)) == len(os.sched_getaffinity(0))
    assert int(_child(code, pre=["taskset", "-c", "0"])) == 1


def test_usable_cpus_follows_a_cgroup_cpu_quota(tmp_path):
    """A container's --cpus: torch would start one thread per host CPU, and they would wait for each other."""
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    parent = Path("/sys/fs/cgroup") if v2 else Path("/sys/fs/cgroup/cpu")
    if os.geteuid() != 0 or not os.access(parent, os.W_OK):
        pytest.skip("needs root and a writable cpu cgroup")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs to see a quota of 1")
    cg = parent / f"sluice-test-cpu-{os.getpid()}"
    try:
        cg.mkdir()
        if v2:
            (cg / "cpu.max").write_text("100000 100000")
        else:
            (cg / "cpu.cfs_period_us").write_text("100000")
            (cg / "cpu.cfs_quota_us").write_text("100000")
    except OSError as e:
        cg.exists() and cg.rmdir()
        pytest.skip(f"cannot set a cpu quota: {e}")
    try:
        code = "from sluice.host.cpus import usable_cpus; print(usable_cpus())"
        out = subprocess.run(["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cg / "cgroup.procs"),
                              sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
        assert int(out.stdout.strip()) == 1
    finally:
        cg.rmdir()
