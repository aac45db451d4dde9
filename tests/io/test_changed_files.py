"""A weight file that changes under a running model ends in a CheckpointError naming it, in every io mode.

Truncated (in the middle or by one byte), rewritten in place (same size), or replaced by a new file before the reader
first opened it; after load and between generation steps; through the expert store and the lazy embedding table.
Each case runs in a child process (changed_file_child.py) so a SIGBUS shows as a signal exit, not a dead pytest.
A truncation that lands DURING a mapping reader's copy still raises SIGBUS (documented in io/mapped.py); these
tests change the file between steps, which is what a check before each batch can and must catch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.checkpoint import write_sharded
from sluice.tools.synth import SynthConfig, config_json, tensors

CHILD = Path(__file__).with_name("changed_file_child.py")
WORDS = {
    "truncate": "truncated from", "truncate-tail": "truncated from", "rewrite": "rewritten in place",
    "replace": "replaced by another file",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    sc = SynthConfig(arch="qwen3_moe", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     num_experts=8, top_k=2, moe_intermediate_size=64, vocab_size=300, dtype="float32")
    folder = tmp_path_factory.mktemp("changed") / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config_json(sc)))
    write_sharded(folder, tensors(sc), max_shard_bytes=1 << 30)  # one file: every read goes to the changed one
    return folder


def run_child(model_dir: Path, tmp_path: Path, scenarios: list[str]) -> list[dict]:
    r = subprocess.run([sys.executable, str(CHILD), str(model_dir), str(tmp_path), *scenarios],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"child exited {r.returncode} (negative: killed by a signal)\n{r.stderr[-3000:]}"
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [x["scenario"] for x in results] == scenarios, r.stdout + r.stderr[-3000:]
    return results


def check_errors(results: list[dict]) -> None:
    for x in results:
        how = x["scenario"].split(":")[-1].rsplit("-", 2)[0]
        assert "error" in x, f"{x['scenario']}: the changed file was read without an error"
        assert x["type"] == "CheckpointError" and x["file"] == x["weights"], x
        assert x["weights"] in x["error"] and WORDS[how] in x["error"], x


# Streamed experts: every decode step reads expert bytes through the reader.
STREAMED = ["truncate-between-stream", "truncate-tail-between-stream", "rewrite-between-stream",
            "truncate-before-stream", "replace-before-stream"]
# Experts resident (all read through the reader at load): afterwards only the lazy embedding RowTable reads the
# file. Its reader is the model's when the kinds match (then the file is already open: no replace-before case).
ROWS = {
    "mmap": [("mmap", ["truncate", "rewrite"]), ("direct", ["truncate", "rewrite", "replace"])],
    "willneed": [("mmap", ["truncate", "rewrite"])],
    "direct": [("direct", ["truncate", "rewrite"]), ("mmap", ["truncate", "rewrite", "replace"])],
}


@pytest.mark.parametrize("io,odirect", [("mmap", False), ("willneed", False), ("direct", False), ("direct", True)])
def test_changed_weight_file_is_a_checkpoint_error(model_dir, tmp_path, io, odirect):
    prefix = f"{io}:{int(odirect)}"
    # An O_DIRECT reader opens the experts' files at load (the streaming store asks their O_DIRECT alignment to place
    # its slots: store/streaming.py _alignment): a file replaced after that is the `kept` case below
    opened = ["replace-before-stream"] if odirect else []
    scenarios = [f"{prefix}:resident:{case}" for case in STREAMED if case not in opened]
    for embeddings, hows in ROWS[io] if not odirect else []:
        when = {"replace": "before"}
        scenarios += [f"{prefix}:{embeddings}:{how}-{when.get(how, 'between')}-resident" for how in hows]
    # Not an error: once a reader has the file open, a new file renamed over it is another inode; the old one's
    # bytes stay readable and are still the ones the header described. It is said, once (it went unnoticed).
    kept = [f"{prefix}:resident:{case}" for case in ["replace-between-stream", *opened]]
    results = run_child(model_dir, tmp_path, scenarios + kept)
    check_errors(results[: len(scenarios)])
    for x in results[len(scenarios) :]:
        assert x.get("ok") and x["warnings"] == [
            f"file {x['weights']} was replaced by another file after it was opened; this run goes on reading the "
            "version it opened (the one its header described): reload the model to use the file now at that "
            "path"], x
