"""What happens around each child: the model's page-cache state before it (verified cold, or warm), and the child
process itself, optionally inside a memory cgroup that charges the page cache too (a simulated small host)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..io.residency import ResidencyError, evict, resident_bytes, run_in_memory_cgroup, verify_cold, warm
from ..units import format_bytes
from . import BenchError
from ..plan import open_index

MAX_COLD_FRACTION = 0.01  # "verified cold": at most 1% of the model's pages cached before a run


def model_files(folder: str | os.PathLike[str]) -> list[Path]:
    """Every regular file of the model folder (weights, config, tokenizer): all of it is what a run may read.
    A GGUF model is its file and, when split, its other parts (the checkpoint index finds them)."""
    if Path(folder).is_file():

        return sorted(Path(p) for p in open_index(folder).files)
    return sorted(p for p in Path(folder).iterdir() if p.is_file())


def residency(files: list[Path]) -> dict[str, Any]:
    """Bytes-weighted resident fraction of `files`, and the largest per-file fraction (mincore, reads nothing)."""
    per_file: dict[str, float] = {}
    total = cached = 0
    for f in files:
        res, size = resident_bytes(f)
        res = min(res, size)  # the last page counts whole; a 10-byte file is 100% or 0%
        per_file[f.name] = res / size if size else 0.0
        total, cached = total + size, cached + res
    return {"resident_fraction": cached / total if total else 0.0, "resident_bytes": cached, "bytes": total,
            "files": per_file}


def prepare(files: list[Path], state: str | None, what: str) -> dict[str, Any] | None:
    """Put the model's files into `state` ("cold" | "warm" | None) before the run described by `what`.

    cold: evict every file, then verify with mincore that each holds at most 1% resident; otherwise BenchError
    with the figure (a process that maps the files -- a running model, an mmap -- keeps its pages cached).
    warm: read every file once so it sits in the page cache. Returns the measured residency (None: untouched).
    """
    if state is None:
        return None
    if state == "warm":
        for f in files:
            warm(f)
        return {"state": "warm", **residency(files)}
    if state != "cold":
        raise ValueError(f"state must be 'cold', 'warm' or None, got {state!r}")
    for f in files:
        evict(f)
    r = residency(files)
    try:
        verify_cold(files, MAX_COLD_FRACTION)
    except ResidencyError as e:  # names each file above the limit, and a memory filesystem eviction cannot empty
        raise BenchError(f"not cold before {what}: {r['resident_fraction']:.1%} of the model "
                         f"({format_bytes(r['resident_bytes'])} of {format_bytes(r['bytes'])}) is still cached after "
                         f"eviction, above the {MAX_COLD_FRACTION:.0%} limit: {e}; a process that maps these files "
                         "keeps them resident: stop it and retry") from None
    return {"state": "cold", **r}


def check_ceiling(limit: int) -> None:
    """Fail early, before any child, when no memory cgroup can be made here (the message says what was tried)."""
    try:
        run_in_memory_cgroup(["/bin/true"], limit)
    except ResidencyError as e:
        raise BenchError(
            f"--ceiling needs a writable memory cgroup (root, and cgroup v2 with the memory controller or the v1 "
            f"memory hierarchy mounted): {e}"
        ) from e


@dataclass
class ChildResult:
    """How a child ended. `record` is its JSON line (None if it printed none: killed, or crashed)."""

    record: dict[str, Any] | None
    returncode: int
    oom_killed: bool
    cgroup_peak_bytes: int
    wall_s: float
    stderr_tail: str
    timed_out: float | None = None  # the limit (seconds) the child ran past and was killed at

    def error(self) -> str | None:
        """None when the child succeeded; else why not, in one line."""
        if self.timed_out is not None:
            return f"killed after {self.timed_out:g} s (--run-timeout): it had not finished"
        if self.oom_killed:
            return "OOM-killed under the memory ceiling"
        if self.record is not None and not self.record.get("ok", False):
            return str(self.record.get("error", "failed"))
        if self.returncode != 0 or self.record is None:
            tail = self.stderr_tail.strip().splitlines()[-1:] or ["no output"]
            return f"exit status {self.returncode}: {tail[0]}"
        return None


def child_env() -> dict[str, str]:
    """The environment with this sluice first on the path, so `-m sluice.bench.child` runs the same code."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def child_argv(mode: str, model: str, options: dict[str, Any], **extra: Any) -> list[str]:
    """argv of `python -m sluice.bench.child MODE ...`; `extra` become --key value flags (None and False values
    dropped, True ones a bare --key)."""
    argv = [sys.executable, "-m", "sluice.bench.child", mode, "--model", str(model), "--options", json.dumps(options)]
    for k, v in extra.items():
        if v is True:
            argv.append(f"--{k.replace('_', '-')}")
        elif v is not None and v is not False:
            argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


def arm_argv(arm, mode: str, model: str, peer_python: str | None = None, **extra: Any) -> list[str]:
    """argv of the child that runs `arm` (an arms.Arm): sluice's child, or for a peer arm the peer child run by the
    peers' interpreter (`peer_python`), which replays only (a peer never generates the reference sequence)."""
    if arm.peer is None:
        return child_argv(mode, model, arm.options, **extra)
    if mode != "replay":
        raise BenchError(f"arm {arm.name!r} is a peer ({arm.peer}); the first (reference) arm must be a sluice arm")
    from .peers import peer_argv

    return peer_argv(str(peer_python), arm.peer, arm.options, model, **extra)


def _last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def _wait_child(argv: list[str], ceiling: int | None, timeout: float | None, out, err) -> tuple[int, bool, int]:
    """(returncode, OOM-killed, cgroup peak bytes) of the child; subprocess.TimeoutExpired past `timeout` (killed)."""
    if ceiling is None:
        return subprocess.run(argv, stdout=out, stderr=err, env=child_env(), timeout=timeout).returncode, False, 0
    try:
        r = run_in_memory_cgroup(argv, ceiling, timeout=timeout, env=child_env(), stdout=out.fileno(),
                                 stderr=err.fileno())
    except ResidencyError as e:
        raise BenchError(f"--ceiling: {e}") from e
    return r.returncode, r.oom_killed, r.peak_bytes


def run_child(argv: list[str], ceiling: int | None = None, timeout: float | None = None) -> ChildResult:
    """Run a child to completion, under a memory cgroup of `ceiling` bytes if given; never raises for the child's
    own failure (OOM kill, crash): those are results. Output goes through files, not pipes, so a large result
    line cannot block a child that the harness waits for. A child still running after `timeout` seconds is killed
    (its whole cgroup under a ceiling) and reported as timed out."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        try:
            rc, oom, peak = _wait_child(argv, ceiling, timeout, out, err)
        except subprocess.TimeoutExpired:
            return ChildResult(None, -9, False, 0, time.perf_counter() - t0, "", timed_out=timeout)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        record = _last_json(out.read().decode(errors="replace"))
        tail = err.read().decode(errors="replace")[-4000:]
    return ChildResult(record, rc, oom, peak, wall, tail)
