"""The `sluice` command line: run --json contract, inspect, and clean errors (no tracebacks) on bad input."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys

import pytest
import torch

from sluice import cli
from sluice.tools.tokenizer_train import train_tokenizer

from .models.tiny import hf_model, write_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = write_checkpoint(hf_model("qwen3_moe", torch.bfloat16), tmp_path_factory.mktemp("cli"), "per_expert")
    train_tokenizer(folder, vocab_size=300)
    return folder


def sluice_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluice", *args], capture_output=True, text=True, timeout=300,
                          errors="replace", **kw)


def test_run_json_prints_one_object(model_dir):
    r = sluice_cli("run", str(model_dir), "--prompt", "hello world", "--max-tokens", "6", "--json",
                   "--memory", "10MiB")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert set(out) == {"tokens", "text", "stats"}
    assert 1 <= len(out["tokens"]) <= 6 and all(isinstance(t, int) for t in out["tokens"])
    for key in ("tokens", "ms_per_token", "hits", "misses", "bytes_read", "major_faults", "peak_rss_bytes"):
        assert key in out["stats"]


def test_run_text_and_stats_line(model_dir):
    r = sluice_cli("run", str(model_dir), "--prompt", "hello", "--max-tokens", "4", "--io", "mmap")
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stderr and "hit rate" in r.stderr


def test_inspect_reports_split_and_usage(model_dir):
    r = sluice_cli("inspect", str(model_dir), "--memory", "1MiB", "--json", "--usage-tokens", "16")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["model_type"] == "qwen3_moe" and info["moe_layers"] == 2
    assert info["expert_slots"] >= info["top_k"]
    assert len(info["usage"]["experts_used_per_layer"]) == 2


@pytest.mark.parametrize(
    "args,needle",
    [
        (["run", "/nonexistent/model", "--prompt", "x"], "/nonexistent/model"),
        (["run", "{model}", "--prompt", "x", "--memory", "1KiB"], "smallest budget"),
        (["run", "{model}", "--prompt", "x", "--memory", "lots"], "memory"),
        (["run", "{model}", "--prompt", "x", "--temperature", "-1"], "temperature"),
        (["run", "{model}", "--prompt", "x", "--max-tokens", "0"], "max-tokens"),
        # a seed torch cannot take (was a ValueError traceback)
        (["run", "{model}", "--prompt", "x", "--temperature", "1", "--seed", str(2**64)], "seed must be in"),
        (["run", "{model}", "--prompt", "x", "--seed", str(-(2**63) - 1)], "64 bits"),
        # bytes that are not UTF-8 (argv decodes them to lone surrogates; was a TypeError traceback)
        (["run", "{model}", "--prompt", "a\udcffb"], "U+DCFF"),
        (["chat", "{model}", "--system", "\udc80"], "--system is not valid text"),
        # runaway flags (10^5 I/O workers was a traceback, 10^9 an OOM kill; 10^5 threads a SIGSEGV)
        (["run", "{model}", "--prompt", "x", "--io-workers", "100000"], "io_workers: must be an integer from 0"),
        (["run", "{model}", "--prompt", "x", "--threads", "100000"], "logical CPUs"),
        (["prerouter", "fit", "{model}", "--tokens", str(10**12), "--no-progress"], "record fewer tokens"),
    ],
)
def test_bad_input_is_a_clean_error(model_dir, args, needle):
    r = sluice_cli(*[a.replace("{model}", str(model_dir)) for a in args])
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if "error:" in ln]) == 1


@pytest.mark.parametrize("template,needle", [
    ("{{ 'x' * 300000000 }}", "'*' makes 300,000,000 characters"),
    ("{% for i in range(100000000) %}{% endfor %}", "failed at line 1: OverflowError"),  # was "internal error"
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deeply"),
])
def test_a_failing_chat_template_is_one_error_line_naming_it(model_dir, tmp_path, template, needle):
    folder = shutil.copytree(model_dir, tmp_path / "m")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    r = sluice_cli("run", str(folder), "--prompt", "hi", "--chat", "--max-tokens", "2")
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert lines[0].startswith(f"sluice run: error: the chat template of model {folder}") and needle in lines[0]


def test_unknown_model_type_lists_supported(model_dir, tmp_path):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
    r = sluice_cli("run", str(tmp_path), "--prompt", "x")
    assert r.returncode == 2 and "qwen3_moe" in r.stderr and "mixtral" in r.stderr and "Traceback" not in r.stderr


def test_chat_refuses_a_non_utf8_line_and_goes_on(model_dir):
    r = subprocess.run([sys.executable, "-m", "sluice", "chat", str(model_dir), "--max-tokens", "2"],
                       input=b"caf\xe9\nhello\n/quit\n", capture_output=True, timeout=300)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 0 and "Traceback" not in err, err
    assert "the message is not valid text: character 3 is U+DCE9" in err and "byte 0xE9" in err
    assert "tok/s" in err  # the next line was answered


@pytest.fixture
def broken_inspect(monkeypatch):
    """`sluice inspect` made to raise whatever the test sets as `broken_inspect.error`."""

    class Broken:
        error: BaseException = ValueError("boom")

    def main(args):
        raise Broken.error

    monkeypatch.setattr("sluice.commands.inspect.main", main)
    return Broken


def test_unexpected_exception_is_one_internal_error_line(broken_inspect, capsys, monkeypatch):
    monkeypatch.delenv("SLUICE_DEBUG", raising=False)
    assert cli.main(["inspect", "anything"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == ["sluice inspect: error: internal error: ValueError: boom (a bug in sluice: please "
                                "report it with the command line; SLUICE_DEBUG=1 prints the traceback)"]
    monkeypatch.setenv("SLUICE_DEBUG", "1")
    broken_inspect.error = RecursionError("maximum recursion depth exceeded")
    assert cli.main(["inspect", "anything"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.splitlines()[-1].startswith(
        "sluice inspect: error: internal error: RecursionError: maximum recursion depth exceeded")


@pytest.mark.parametrize("error,line", [
    (PermissionError(errno.EACCES, "Permission denied", "/models/x"),
     "sluice inspect: error: /models/x: Permission denied (check the permissions of the file and its folder)"),
    (OSError(errno.ENOSPC, "No space left on device"),
     "sluice inspect: error: No space left on device (the disk is full: free space on it, or write somewhere else)"),
])
def test_os_error_is_one_line_naming_the_path(broken_inspect, capsys, error, line):
    broken_inspect.error = error
    assert cli.main(["inspect", "anything"]) == 2
    assert capsys.readouterr().err.splitlines() == [line]


def test_out_of_memory_and_rust_panics_are_one_line(broken_inspect, capsys):
    broken_inspect.error = RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate "
                                        "memory: you tried to allocate 2048000000000 bytes.")
    assert cli.main(["inspect", "anything"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "sluice inspect: error: out of memory: free memory, or ask for less (--memory, --max-context, a smaller "
        "model)"]

    class PanicException(BaseException):  # what pyo3 raises for a panic in tokenizers or safetensors
        pass

    broken_inspect.error = PanicException("called `Option::unwrap()` on a `None` value\nnote: run with backtrace")
    assert cli.main(["inspect", "anything"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("sluice inspect: error: internal error: PanicException: called `Option::unwrap()` on a "
                           "`None` value note: run with backtrace (a bug in sluice")


@pytest.mark.parametrize("flags,needle", [
    (["--size", "4MiB", "--layers", "1000000000"], "over twice the target size 4.0 MiB (shape overrides: "
                                                   "num_layers)"),  # wrote until the disk was full
    (["--size", "4MiB", "--hidden", "1000000000"], "over twice the target size"),  # a 2 TB allocation
    (["--size", "100TiB", "--vocab", "2000000000"], "at most 1,048,576 tokens"),  # a Rust abort asking for 140 GB
])
def test_make_model_runaway_shapes_are_refused(tmp_path, capsys, flags, needle):
    out = tmp_path / "m"
    assert cli.main(["make-model", str(out), "--arch", "qwen3_moe", "--no-progress", *flags]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("sluice make-model: error: ") and needle in line, line
    assert list(tmp_path.iterdir()) == []


def _bad_folder(tmp_path, kind: str):
    """A model folder broken in one way the checkpoint layer must refuse with a CheckpointError."""
    import struct

    from sluice.checkpoint import write_safetensors

    folder = tmp_path / kind
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    weights = write_safetensors(folder / "model.safetensors", {"w": torch.ones(3)})
    if kind == "shifted-header":  # the header length cut by one byte into its padding: every tensor read 1 byte off
        blob = weights.read_bytes()
        (n,) = struct.unpack("<Q", blob[:8])
        weights.write_bytes(struct.pack("<Q", n - 1) + blob[8:])
    elif kind == "deep-config":
        (folder / "config.json").write_text('{"a": ' + "[" * 50_000 + "]" * 50_000 + "}")
    elif kind == "index-outside":
        weights.rename(tmp_path / "elsewhere.safetensors")
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"w": "../elsewhere.safetensors"}}))
    return folder


@pytest.mark.parametrize(
    "kind, needle",
    [("shifted-header", "left over"), ("deep-config", "nested"), ("index-outside", "not a file inside")],
)
def test_inspect_bad_checkpoint_prints_one_error_line(tmp_path, kind, needle):
    r = sluice_cli("inspect", str(_bad_folder(tmp_path, kind)))
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("sluice inspect: error: ") and needle in lines[0] and "Traceback" not in r.stderr


def test_model_paths_say_what_they_are(tmp_path, capsys):
    """A FIFO or a symbolic link loop named .gguf was "not found", and a missing folder "not a directory"."""
    import os

    os.mkfifo(tmp_path / "fifo.gguf")
    for a, b in (("loop.gguf", "loop2.gguf"), ("loop", "loop2")):
        (tmp_path / a).symlink_to(tmp_path / b)
        (tmp_path / b).symlink_to(tmp_path / a)
    (tmp_path / "weights.bin").write_bytes(b"x")
    cases = [
        ("missing", "not found; pass a Hugging Face model folder or a .gguf file"),
        ("missing.gguf", "not found; pass a .gguf file"),
        ("fifo.gguf", "is a FIFO; pass a .gguf file"),
        ("loop.gguf", "is a symbolic link loop; pass a .gguf file"),
        ("loop", "is a symbolic link loop; pass a Hugging Face model folder or a .gguf file"),
        ("weights.bin", "is a file, not a folder (a GGUF file's name ends in .gguf); pass a Hugging Face model "
                        "folder or a .gguf file"),
    ]
    for name, message in cases:
        assert cli.main(["inspect", str(tmp_path / name)]) == 2
        assert capsys.readouterr().err.strip() == f"sluice inspect: error: file {tmp_path / name}: {message}"


def test_sluice_warnings_are_one_line(monkeypatch, capsys):
    """A model file replaced during a run is said as one `warning:` line, as a budget that may not fit is."""
    import warnings

    from sluice.errors import MemoryWarning, ModelFileWarning

    def main(args):
        warnings.warn("file /m/model.safetensors was replaced by another file after it was opened", ModelFileWarning)
        warnings.warn("--memory 1.0 GiB keeps ...", MemoryWarning)
        return 0

    monkeypatch.setattr("sluice.commands.inspect.main", main)
    assert cli.main(["inspect", "anything"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "sluice inspect: warning: file /m/model.safetensors was replaced by another file after it was opened",
        "sluice inspect: warning: --memory 1.0 GiB keeps ..."]
