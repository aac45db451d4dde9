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


_HEAP_CHILD = """
import resource, sys
import torch
from sluice.host.memory import keep_heap
if sys.argv[1] == "keep":
    assert keep_heap(256 << 20)
def layer():  # a prefill layer's blocks, 6, 10 and 8 MiB, allocated and freed in turn
    a = torch.ones(3 << 20, dtype=torch.bfloat16); b = torch.ones(5 << 20, dtype=torch.bfloat16)
    del a; c = torch.ones(2 << 20); del b, c
layer()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    layer()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


@pytest.mark.skipif(not os.path.exists("/lib/x86_64-linux-gnu/libc.so.6") and not os.path.exists("/lib64/libc.so.6"),
                    reason="keep_heap tunes glibc's malloc")
def test_keep_heap_stops_refaulting_a_prefills_blocks():
    """With the heap kept, blocks freed by one layer serve the next without new page faults; glibc's default
    (sliding mmap threshold, trimming) faults them in again (10 layers of 6 + 10 + 8 MiB: 0 vs 12,204 faults here)."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[always]" in thp.read_text():
        pytest.skip("transparent huge pages always on: fresh mappings fault once per 2 MiB, the default barely faults")
    faults = {arm: int(subprocess.run([sys.executable, "-c", _HEAP_CHILD, arm], check=True, capture_output=True,
                                      text=True).stdout) for arm in ("keep", "default")}
    assert faults["keep"] < 1000 < faults["default"] and 10 * faults["keep"] < faults["default"], faults


def test_the_plan_keeps_one_chunks_activations(tmp_path):
    from sluice.plan import plan
    from sluice.options import LoadOptions
    from sluice.store.budget import prefill_token_bytes

    from ..models.tiny import hf_model, write_checkpoint

    import torch

    folder = write_checkpoint(hf_model("qwen3_moe", torch.bfloat16), tmp_path / "m", "per_expert")
    p = plan(folder, LoadOptions(prefill_chunk=300))
    assert p.prefill_bytes == 300 * prefill_token_bytes(p.spec, 2, p.max_context) > 0


def _slot_rows(nbytes: int):
    import mmap

    import torch

    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8)


def _in_ram(t) -> int:
    import ctypes
    import mmap

    n = -(-t.numel() // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(t.data_ptr(), n * mmap.PAGESIZE, vec) == 0
    return sum(v & 1 for v in vec)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_DONTNEED) and mincore are Linux's")
def test_released_pages_leave_ram_and_populate_brings_them_back_keeping_written_bytes():
    """release_pages gives whole pages back (they read as zeros); populate_pages faults them in again, in a thread
    when asked, and never overwrites what was written meanwhile (a read landing in a returned slot)."""
    import mmap

    from sluice.host.memory import populate_pages, release_pages

    t = _slot_rows(64 * mmap.PAGESIZE)
    t.fill_(7)
    assert _in_ram(t) == 64
    assert release_pages(t.data_ptr() + 100, 10 * mmap.PAGESIZE) == 9 * mmap.PAGESIZE  # whole pages only
    assert _in_ram(t) == 55 and int(t[mmap.PAGESIZE :].view(-1)[:1]) == 0  # the released pages read as zeros
    assert release_pages(t.data_ptr() + 1, 100) == 0
    t[: 8 * mmap.PAGESIZE].fill_(0)
    assert release_pages(t.data_ptr(), t.numel()) == t.numel() and _in_ram(t) == 0
    thread = populate_pages(t, background=True)
    t[5 * mmap.PAGESIZE : 6 * mmap.PAGESIZE].fill_(3)  # written while it runs
    if thread is not None:  # the kernel populates (Linux 5.14+); else it filled them with zeros at once
        thread.join()
    assert _in_ram(t) == 64
    assert int(t[5 * mmap.PAGESIZE]) == 3 and int(t.sum()) == 3 * mmap.PAGESIZE
