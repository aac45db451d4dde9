"""A full disk while writing an output (make-model, export-gguf, bench --out): one `error:` line naming the path and
what to do, exit 2, and no partial output left behind.

The disk is a real one: a 64 KiB tmpfs mounted for the test (needs root; skipped otherwise). The cleanup of
`bench --out`'s files is also checked without root, with a failing writer.
"""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest

from sluice import cli
from sluice.bench import report

ROOT = Path(__file__).resolve().parents[1]
NO_SPACE = "No space left on device (the disk is full: free space on it, or write somewhere else)"


@pytest.fixture
def full_disk(tmp_path):
    """A folder on a 64 KiB tmpfs: any output bigger than that fails with ENOSPC."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def sluice_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluice", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def test_make_model_on_a_full_disk(full_disk):
    out = full_disk / "m"
    r = sluice_cli("make-model", str(out), "--arch", "qwen3_moe", "--size", "2MiB", "--no-progress")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines() == [f"sluice make-model: error: cannot write {out}: {NO_SPACE}; the partial output "
                                     f"{out}.partial was removed"]
    assert list(full_disk.iterdir()) == []


def test_export_gguf_on_a_full_disk(full_disk, tmp_path):
    model = tmp_path / "m"
    assert sluice_cli("make-model", str(model), "--arch", "qwen3_moe", "--size", "1MiB", "--no-progress",
                      "--layers", "2").returncode == 0
    out = full_disk / "m.gguf"
    r = sluice_cli("export-gguf", str(model), str(out), "--no-progress")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    # (the gguf writer's numpy tofile reports a short write without an errno)
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"sluice export-gguf: error: cannot write {out}: ")
    assert "the disk is full" in line and line.endswith(f"; the partial file {out}.partial was removed")
    assert list(full_disk.iterdir()) == []


@pytest.fixture
def bench_without_runs(monkeypatch):
    """`sluice bench` with the runs skipped (they are not what is tested) and a 1 MiB results.md to write."""
    from sluice.commands import bench

    monkeypatch.setattr(bench.Bench, "reference_sequence", lambda self: {"prompt_ids": [1], "tokens": [2]})
    monkeypatch.setattr(bench.Bench, "replay_round", lambda self, rnd, work: None)
    monkeypatch.setattr(bench.Bench, "results", lambda self, seq: {"summary": {}, "sequence": seq})
    monkeypatch.setattr(bench, "markdown", lambda results: "| the table |\n")
    monkeypatch.setattr(report, "markdown", lambda results: "x" * 2**20)
    monkeypatch.setattr(report, "plot", lambda results, path: path.write_bytes(b"png"))


def _bench(model: Path, out: Path) -> int:
    return cli.main(["bench", str(model), "--arm", "a=--memory all", "--rounds", "1", "--no-floor", "--out", str(out)])


def test_bench_out_on_a_full_disk(full_disk, tmp_path, bench_without_runs, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = full_disk / "results"
    assert _bench(model, out) == 2
    captured = capsys.readouterr()
    assert captured.out == "| the table |\n"  # the result is not lost
    assert captured.err.splitlines()[-1] == (
        f"sluice bench: error: cannot write {out}: {NO_SPACE}; the files were not written (none is left "
        "half-written); the table above on stdout is the result")
    assert list(full_disk.iterdir()) == []


def test_write_all_leaves_nothing_when_a_write_fails(tmp_path, monkeypatch):
    def no_space(results, path):
        path.write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report, "markdown", lambda results: "| table |")
    monkeypatch.setattr(report, "plot", no_space)
    with pytest.raises(OSError):
        report.write_all({"summary": {}}, tmp_path / "new")
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "notes.txt").write_text("mine")
    with pytest.raises(OSError):
        report.write_all({"summary": {}}, tmp_path / "old")
    assert [p.name for p in (tmp_path / "old").iterdir()] == ["notes.txt"]
