"""Residency tools on a real disk: evict/warm move mincore's answer; memory cgroups report OOM kills and peaks."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest

from sluice.io import residency
from sluice.io.residency import (
    ResidencyError,
    evict,
    filesystem_type,
    resident_fraction,
    run_in_memory_cgroup,
    verify_cold,
    warm,
)




@pytest.fixture
def disk_file():
    """A 16 MiB file on a disk-backed filesystem (page-cache residency means nothing on tmpfs)."""
    folder = tempfile.mkdtemp(dir="/var/tmp")
    if filesystem_type(folder) in ("tmpfs", "ramfs", "overlay", ""):
        pytest.skip(f"/var/tmp is {filesystem_type(folder) or 'unknown'}, not a disk")
    path = os.path.join(folder, "weights.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(16 << 20))
    yield path
    os.unlink(path)
    os.rmdir(folder)


def test_evict_then_warm(disk_file):
    evict(disk_file)
    assert resident_fraction(disk_file) <= 0.01
    assert verify_cold([disk_file]) == {disk_file: pytest.approx(0.0, abs=0.01)}
    assert warm(disk_file) == 16 << 20
    assert resident_fraction(disk_file) >= 0.99
    with pytest.raises(ResidencyError, match="not cold"):
        verify_cold([disk_file])


def test_empty_file(tmp_path):
    p = tmp_path / "empty.bin"
    p.write_bytes(b"")
    assert resident_fraction(p) == 0.0


def cgroup_writable() -> str | None:
    """None when a memory cgroup can be made here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    try:
        _, parent, _ = residency._pick_cgroup_parent()
    except ResidencyError as e:
        return str(e)
    if not os.access(parent, os.W_OK):
        return f"{parent} not writable"
    return None


needs_cgroup = pytest.mark.skipif(cgroup_writable() is not None, reason=f"no memory cgroup: {cgroup_writable()}")
ALLOC = "b = bytearray({n} << 20); b[::4096] = b'x' * len(b[::4096])"


@needs_cgroup
def test_cgroup_oom_kill():
    rc, oom, peak = run_in_memory_cgroup([sys.executable, "-c", ALLOC.format(n=300)], 64 << 20, timeout=60)
    assert oom and rc != 0
    assert peak <= 64 << 20


@needs_cgroup
def test_cgroup_generous_limit():
    res = run_in_memory_cgroup([sys.executable, "-c", ALLOC.format(n=48)], 512 << 20, timeout=60)
    assert (res.returncode, res.oom_killed) == (0, False)
    assert 48 << 20 <= res.peak_bytes <= 512 << 20


def test_no_cgroup_says_what_was_tried(monkeypatch, tmp_path):
    monkeypatch.setattr(residency, "V2_ROOT", tmp_path / "v2")
    monkeypatch.setattr(residency, "V1_ROOT", tmp_path / "v1")
    with pytest.raises(ResidencyError, match="not cgroup v2.*not mounted"):
        run_in_memory_cgroup(["true"], 1 << 20)


def test_filesystem_type_of_proc_and_a_memory_fs_refused_as_cold(tmp_path):
    assert filesystem_type("/proc/self/status") == "proc"
    if not os.path.isdir("/dev/shm") or filesystem_type("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    path = tempfile.mktemp(dir="/dev/shm")
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20))
    try:
        evict(path)
        with pytest.raises(ResidencyError, match="memory-backed filesystem"):
            verify_cold([path])
    finally:
        os.unlink(path)
