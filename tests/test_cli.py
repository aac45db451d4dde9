"""The `sluice` command line: run --json contract, inspect, and clean errors (no tracebacks) on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from sluice.tokenizer_train import train_tokenizer

from .models.tiny import hf_model, write_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = write_checkpoint(hf_model("qwen3_moe", torch.bfloat16), tmp_path_factory.mktemp("cli"), "per_expert")
    train_tokenizer(folder, vocab_size=300)
    return folder


def sluice_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluice", *args], capture_output=True, text=True, timeout=300)


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
    ],
)
def test_bad_input_is_a_clean_error(model_dir, args, needle):
    r = sluice_cli(*[a.replace("{model}", str(model_dir)) for a in args])
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_model_type_lists_supported(model_dir, tmp_path):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
    r = sluice_cli("run", str(tmp_path), "--prompt", "x")
    assert r.returncode == 2 and "qwen3_moe" in r.stderr and "mixtral" in r.stderr and "Traceback" not in r.stderr


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
