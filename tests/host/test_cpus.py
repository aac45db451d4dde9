"""host/cpus.py: the CPUs this process may use (affinity, cgroup quota) and the ThreadGovernor that follows the CPUs
other processes leave free (real cgroups and taskset where root can make them; the governor on fake /proc readings)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.host.cpus import ThreadGovernor, bf16_dot


def _child(code: str, env: dict | None = None, pre: list[str] | None = None) -> str:
    env = {k: v for k, v in (env if env is not None else os.environ).items()}
    return subprocess.run([*(pre or []), sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip()


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


class _FakeHost:
    """/proc/stat's busy ticks, this process's own ticks and a clock, advanced by hand."""

    def __init__(self):
        self.t, self.busy, self.own = 0.0, 0, 0.0
        self.set_calls: list[int] = []

    def run(self, seconds: float, others_cpus: float, own_cpus: float) -> None:
        hz = os.sysconf("SC_CLK_TCK")
        self.t += seconds
        self.busy += round((others_cpus + own_cpus) * seconds * hz)
        self.own += own_cpus * seconds * hz

    def governor(self, usable: int) -> ThreadGovernor:
        return ThreadGovernor(usable, interval=0.25, set_threads=self.set_calls.append,
                              busy_ticks=lambda: self.busy, own_ticks=lambda: self.own, clock=lambda: self.t)


def test_governor_gives_up_a_thread_while_another_process_is_busy_and_takes_it_back():
    host = _FakeHost()
    g = host.governor(2)
    host.run(0.5, others_cpus=0.0, own_cpus=2.0)
    assert g.tick() == 2 and host.set_calls == []  # quiet: both CPUs are ours
    host.run(0.5, others_cpus=1.0, own_cpus=1.0)  # a spinning process took one CPU
    assert g.tick() == 1 and host.set_calls == [1]
    host.run(0.1, others_cpus=0.0, own_cpus=2.0)
    assert g.tick() == 1  # within the interval: no new sample
    host.run(0.5, others_cpus=0.05, own_cpus=1.0)  # it ended (a shell blip of 5% does not count)
    assert g.tick() == 2 and host.set_calls == [1, 2] and g.changes == 2


def test_governor_keeps_at_least_one_thread_and_at_most_usable():
    host = _FakeHost()
    g = host.governor(4)
    host.run(1.0, others_cpus=7.0, own_cpus=1.0)  # an 8-CPU host under heavy load, we may use 4
    assert g.tick() == 1
    host.run(1.0, others_cpus=1.0, own_cpus=1.0)
    assert g.tick() == 3
    host.run(1.0, others_cpus=0.0, own_cpus=3.0)
    assert g.tick() == 4


def test_governor_without_proc_stat_changes_nothing():
    host = _FakeHost()
    g = ThreadGovernor(2, set_threads=host.set_calls.append, busy_ticks=lambda: None, own_ticks=lambda: 0.0,
                       clock=lambda: host.t)
    host.t += 10
    assert g.tick() == 2 and host.set_calls == []


def test_an_explicit_thread_count_is_not_governed(tmp_path):
    import torch

    import sluice

    from ..models.tiny import hf_model, write_checkpoint

    folder = write_checkpoint(hf_model("qwen3_moe", torch.bfloat16), tmp_path / "m", "per_expert")
    with sluice.load(folder, memory="all", threads=1) as m:
        assert m.governor is None and torch.get_num_threads() == 1
    if len(os.sched_getaffinity(0)) > 1:
        with sluice.load(folder, memory="all") as m:
            assert m.governor is not None and m.stats()["threads"] == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("flags, native", [
    ("fpu sse2 avx2 fma avx512f avx512_bf16 avx512_vnni", True),  # AMD EPYC (Zen 4/5), Cooper Lake
    ("fpu sse2 avx2 fma avx512f amx_bf16 amx_tile", True),  # Sapphire Rapids
    ("fpu sse2 avx2 fma avx_vnni", False),  # AVX2 only: torch's bf16 GEMM has no native kernel
    ("fpu sse2 avx2 avx512f avx512bw", False),  # AVX-512 without its bf16 extension
])
def test_bf16_dot_reads_the_cpu_flags(tmp_path, flags, native):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    assert bf16_dot(info) is native


def test_bf16_dot_is_false_without_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")  # aarch64 names its features otherwise
    assert bf16_dot(info) is False
    assert bf16_dot(tmp_path / "missing") is False


def test_importing_sluice_sets_a_short_openmp_spin_unless_a_policy_is_given():
    """sluice/__init__.py: torch's OpenMP workers spin ~10 us after each op, then sleep (PASSIVE with
    GOMP_SPINCOUNT=1000), set before torch loads libgomp; a policy the environment names is kept, spin count and
    all, and a spin count given alone stays."""
    import os
    import subprocess
    import sys

    code = "import os, sluice; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    for given, want in (({}, ["PASSIVE", "1000"]), ({"OMP_WAIT_POLICY": "ACTIVE"}, ["ACTIVE", "None"]),
                        ({"GOMP_SPINCOUNT": "3000"}, ["PASSIVE", "3000"])):
        out = subprocess.run([sys.executable, "-c", code], env={**env, **given}, capture_output=True, text=True,
                             check=True).stdout
        assert out.split() == want, given


def test_describe_cpu_names_the_model_the_simd_flags_and_the_caps(tmp_path, monkeypatch):
    from sluice.host.cpus import cpu_line, describe_cpu

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9999\nflags\t\t: fpu sse avx avx2 fma avx512f "
                    "avx512_vnni avx512_bf16 amx_tile\nprocessor\t: 1\nmodel name\t: AMD EPYC 9999\n")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    cpu = describe_cpu(info)
    assert cpu == {"model": "AMD EPYC 9999", "flags": ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16",
                                                       "amx_tile"], "env": {"ATEN_CPU_CAPABILITY": "avx2"}}
    assert cpu_line(cpu) == ("AMD EPYC 9999 (avx2 fma avx512f avx512_vnni avx512_bf16 amx_tile; "
                             "ATEN_CPU_CAPABILITY=avx2)")
    assert describe_cpu(tmp_path / "missing") == {"model": "unknown", "flags": [], "env": {"ATEN_CPU_CAPABILITY": "avx2"}}
