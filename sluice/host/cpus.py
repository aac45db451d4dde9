"""How many CPUs this process may use (its affinity mask, capped by a cgroup CPU quota), how many of them other
processes leave free right now (ThreadGovernor), and whether they multiply bf16 natively (bf16_dot)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
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


#: /proc/cpuinfo flags of bf16 dot-product instructions, which torch's bf16 GEMM (oneDNN) runs on
BF16_DOT_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def bf16_dot(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has bf16 dot-product instructions (x86 AVX512_BF16 or AMX-BF16 in /proc/cpuinfo's flags).

    It decides how several rows of bf16 activations multiply bf16 weights (LoadOptions.matmul): with them torch's
    bf16 GEMM is the fast one ([256 x 1024] @ [1024 x 1024]: 0.57 ms bf16 vs 2.66 ms via float32 on a 2-core AMD
    EPYC with AVX512_BF16, `benchmarks/prefill/knobs.py matmul`), without them it has no native kernel and float32
    is (AVX2: ~6x the other way, matmul.rows_linear). False where the file is unreadable or has no flags line (not
    Linux x86)."""
    return not BF16_DOT_FLAGS.isdisjoint(_flags(cpuinfo))


def _flags(cpuinfo: Path) -> list[str]:
    """The first `flags` line of /proc/cpuinfo, split; [] where the file is unreadable or has none."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return line.partition(":")[2].split()
    except OSError:
        pass
    return []


def amx_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has AMX bf16 tiles (`amx_bf16` in /proc/cpuinfo's flags), which torch's bf16 GEMM and its
    flash attention (oneDNN) run on: a prompt's [256 x 1024] @ [1024 x 1024] bf16 GEMM takes 0.23 ms on 2 cores of
    an Intel Xeon with AMX against 0.57 on the AMD EPYC's AVX512_BF16 (benchmarks/results/hybrid/README.md's probe),
    so there a prompt's quantized experts are dequantized for it rather than run on the VNNI tiles, and its causal
    attention is torch's (Compute.prompt_planes, attend_prompt). False where the file is unreadable."""
    return "amx_bf16" in _flags(cpuinfo)


#: the /proc/cpuinfo flags a benchmark's CPU line names: the instruction sets sluice's, torch's and llama.cpp's
#: kernels dispatch on
SIMD_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")
#: environment variables that cap torch's kernels below the CPU's best (an AVX2 run on an AVX-512 machine)
CAP_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")  # MKL: torch's float32 GEMM


def describe_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """{"model", "flags", "env"}: the CPU's model name, its SIMD flags (SIMD_FLAGS and every avx512*), and the
    environment variables that cap torch's kernels, as every committed benchmark result records them."""
    model, flags = "unknown", []
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() == "flags":
                    have = value.split()
                    flags = [x for x in have if x in SIMD_FLAGS or x.startswith("avx512")]
                    break
    except OSError:
        pass
    return {"model": model, "flags": flags, "env": {k: os.environ[k] for k in CAP_ENV if k in os.environ}}


def cpu_line(cpu: dict) -> str:
    """describe_cpu's dict as one line: 'AMD EPYC ... (avx2 avx512f ...; ATEN_CPU_CAPABILITY=avx2)'."""
    env = "; ".join(f"{k}={v}" for k, v in cpu.get("env", {}).items())
    return f"{cpu['model']} ({' '.join(cpu['flags']) or 'no SIMD flags read'}{'; ' + env if env else ''})"


def _busy_ticks(stat: Path = Path("/proc/stat")) -> int | None:
    """Clock ticks all CPUs spent busy since boot (user, nice, system, irq, softirq, steal), None if unreadable."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return user + nice + system + irq + softirq + steal


def _own_ticks() -> float:
    t = os.times()
    return (t.user + t.system) * os.sysconf("SC_CLK_TCK")


class ThreadGovernor:
    """Keeps torch's intra-op thread count at the CPUs that other processes leave free.

    OpenMP threads wait for each other at the end of every parallel region; when another busy process holds one of
    two cores, one of ours is always descheduled and every region waits a scheduler slice for it. Measured on the
    2-core VM (benchmarks/results/contention): resident decode of a 1 GiB qwen3_moe went from 41 to 1,944 ms/token
    beside one spinning process with 2 threads. With one thread per free core there is nobody to wait for.
    `tick()` (between decode steps) samples /proc/stat at most every `interval` seconds: the CPUs busy beyond this
    process's own use are other processes'; free = usable - those, rounded with a quarter-CPU margin (a shell
    blip must not cost a thread), at least 1.
    """

    def __init__(self, usable: int, interval: float = 0.25, set_threads: Callable[[int], None] | None = None,
                 busy_ticks: Callable[[], int | None] = _busy_ticks, own_ticks: Callable[[], float] = _own_ticks,
                 clock: Callable[[], float] = time.monotonic):
        import torch

        self.usable, self.interval = usable, interval
        self._set = set_threads or torch.set_num_threads
        self._busy, self._own, self._clock = busy_ticks, own_ticks, clock
        self.threads = usable
        self.changes = 0
        self._last = self._sample()

    def _sample(self) -> tuple[float, int | None, float]:
        return self._clock(), self._busy(), self._own()

    def tick(self) -> int:
        """Re-check at most every `interval` s; set and return the thread count."""
        now = self._clock()
        if now - self._last[0] < self.interval:
            return self.threads
        t1, busy1, own1 = self._sample()
        t0, busy0, own0 = self._last
        self._last = (t1, busy1, own1)
        if busy0 is None or busy1 is None or t1 <= t0:
            return self.threads
        ticks = (t1 - t0) * os.sysconf("SC_CLK_TCK")
        others = max(0.0, (busy1 - busy0) - (own1 - own0)) / ticks  # CPUs other processes kept busy
        free = max(1, min(self.usable, math.floor(self.usable - others + 0.75)))
        if free != self.threads:
            self.threads = free
            self.changes += 1
            self._set(free)
        return self.threads
