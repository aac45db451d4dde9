"""Peer arms of `sluice bench` (llama.cpp, accelerate): parsing, the checks made before any child runs, the peer child
script's independence from sluice, and one end-to-end bench run where a stand-in interpreter plays the peer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sluice import cli
from sluice.bench import BenchError
from sluice.bench.arms import parse_arm, parse_arms
from sluice.bench.peers import CHILD, peer_argv, peer_files

from .test_bench import budgets, cache_home, disk_dir, model_dir  # noqa: F401 (fixtures)


def test_peer_arms_parse_to_the_peer_and_its_options():
    arm = parse_arm("llama.cpp=peer:llama.cpp --madvise random --threads 2")
    assert arm.peer == "llama.cpp"
    assert arm.options["madvise"] == "random" and arm.options["threads"] == 2 and arm.options["mmap"] is True
    assert arm.to_json()["peer"] == "llama.cpp"
    acc = parse_arm("acc=peer:accelerate --max-memory 512MiB")
    assert acc.peer == "accelerate" and acc.options["max_memory"] == "512MiB"
    assert "peer" not in parse_arm("direct=--io direct").to_json()  # sluice arms are unchanged


@pytest.mark.parametrize("spec,needle", [
    ("x=peer:vllm", r"arm 'x'.*names no peer; known: peer:llama.cpp, peer:accelerate"),
    ("y=peer:llama.cpp --bogus", r"arm 'y'.*peer:llama.cpp.*--bogus"),
    ("z=peer:accelerate --max-memory lots", r"max-memory"),
    ("t=peer:llama.cpp --threads 0", r"--threads must be >= 1"),
])
def test_bad_peer_arm_is_a_clear_error(spec, needle):
    with pytest.raises(BenchError, match=needle):
        parse_arm(spec)


def test_gguf_defaults_into_the_model_folder_so_cold_evicts_it(tmp_path):
    arm = parse_arm("l=peer:llama.cpp")
    assert peer_files(arm.peer, arm.options, str(tmp_path)) == [tmp_path / "model.gguf"]
    argv = peer_argv("/peers/python", arm.peer, arm.options, str(tmp_path), work="w.json", warmup=2)
    assert argv[:3] == ["/peers/python", str(CHILD), "replay"]
    assert json.loads(argv[argv.index("--options") + 1])["gguf"] == str(tmp_path / "model.gguf")
    assert argv[-4:] == ["--work", "w.json", "--warmup", "2"]
    assert peer_files("accelerate", parse_arm("a=peer:accelerate").options, str(tmp_path)) == []


def test_peer_child_imports_nothing_from_sluice():
    """The peers' interpreter has no sluice installed, and a llama.cpp process must not carry torch's memory."""
    code = (f"import runpy, sys; sys.argv = ['peer_child.py', '--help']\n"
            f"try:\n    runpy.run_path({str(CHILD)!r}, run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('sluice', 'torch', 'numpy')]\n"
            "assert not bad, bad\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/")
    assert r.returncode == 0, r.stderr
    assert "replay" in r.stdout


def test_bench_refuses_a_peer_reference_or_a_missing_interpreter(model_dir, tmp_path, capsys):
    assert cli.main(["bench", str(model_dir), "--arm", "l=peer:accelerate", "--no-floor"]) == 2
    assert "first arm is the reference and must be a sluice arm" in capsys.readouterr().err
    assert cli.main(["bench", str(model_dir), "--arm", "d=--io direct", "--arm", "a=peer:accelerate",
                     "--no-floor"]) == 2
    assert "--peer-python" in capsys.readouterr().err
    assert cli.main(["bench", str(model_dir), "--arm", "d=--io direct", "--arm", "l=peer:llama.cpp",
                     "--peer-python", sys.executable, "--no-floor"]) == 2
    assert "sluice export-gguf" in capsys.readouterr().err  # no model.gguf yet


STAND_IN = '''#!{python}
"""Stands in for the peers' interpreter: answers peer_child.py's replay with a record shaped like its own."""
import json, sys
argv = sys.argv[2:]
opt = lambda k: argv[argv.index(k) + 1]
work, warmup = json.load(open(opt("--work"))), int(opt("--warmup"))
tokens = work["tokens"]
steps = [0.01] * len(tokens)
print(json.dumps({{"ok": True, "argmax": tokens + [0], "load_s": 0.1, "prefill_s": 0.2,
    "warmup_step_s": steps[:warmup], "step_s": steps[warmup:],
    "window": {{"disk_read_bytes": 4096 * len(steps[warmup:]), "major_faults": 3, "minor_faults": 5, "cpu_s": 0.1,
                "wall_s": 0.1, "steps": len(steps[warmup:]), "hits": 0, "misses": 0}},
    "peak_rss_bytes": 123 << 20, "stats": {{}}, "peer": {{"kind": opt("--peer"), "argv": argv}}}}))
'''


def test_end_to_end_with_a_stand_in_peer(model_dir, tmp_path, cache_home, capsys):
    """Routing, rotation and the identity gate over a peer arm; a peer has no store, so no hit rate or floor."""
    bf16, _ = budgets(model_dir, capsys)
    fake = tmp_path / "peer-python"
    fake.write_text(STAND_IN.format(python=sys.executable))
    fake.chmod(0o755)
    out = tmp_path / "out"
    warmup, steps = 2, 3
    rc = cli.main(["bench", str(model_dir), "--arm", f"ref=--io direct --memory {bf16}",
                   "--arm", "acc=peer:accelerate --max-memory 1MiB", "--peer-python", str(fake),
                   "--rounds", "2", "--steps", str(steps), "--warmup", str(warmup), "--prompt-tokens", "5",
                   "--cold", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    results = json.loads((out / "results.json").read_text())
    assert results["arms"][1]["peer"] == "accelerate" and results["meta"]["peer_python"] == str(fake)
    acc = [r for r in results["runs"] if r["arm"] == "acc"]
    assert len(acc) == 2 and all(r["residency"]["state"] == "cold" for r in acc)
    rec = acc[0]["record"]
    assert rec["peer"]["kind"] == "accelerate" and "--work" in rec["peer"]["argv"]
    assert json.loads(rec["peer"]["argv"][rec["peer"]["argv"].index("--options") + 1])["max_memory"] == "1MiB"
    s = results["summary"]["acc"]
    assert s["step_ms_median"] == pytest.approx(10.0) and s["hit_rate"] is None and s["floor_ms"] is None
    assert s["disk_read_bytes_per_step"] == 4096 and s["pair"]["pairs"] == 2
    # the stand-in echoes the greedy tokens: every step but the last (after the final token) agrees
    ident = results["identity"]["arms"]["acc"]
    assert ident["steps_compared"] == 2 * (warmup + steps + 1) and ident["mismatched_steps"] <= 2
    assert "| acc |" in captured.out


def test_parse_arms_keeps_order_with_peers():
    arms = parse_arms(["d=--io direct", "l=peer:llama.cpp", "a=peer:accelerate"])
    assert [a.peer for a in arms] == [None, "llama.cpp", "accelerate"]
    assert Path(CHILD).is_file()


def test_a_gguf_model_is_its_own_peer_file_and_cold_set(tmp_path):
    """`sluice bench model.gguf`: llama.cpp reads the same file, and the cold protocol evicts every split part."""
    from sluice.bench.launch import model_files
    from sluice.commands.bench import _check
    from tests.checkpoint.gguf_files import GGUF_TINY, convert
    from tests.models.tiny import hf_model

    first = convert(hf_model("qwen3_moe", **GGUF_TINY["qwen3_moe"]), tmp_path / "m.gguf", split_max_tensors=10)
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) > 1 and first == parts[0]
    assert model_files(first) == parts
    arm = parse_arm("l=peer:llama.cpp")
    assert peer_files(arm.peer, arm.options, str(first)) == [first]
    args = cli.build_parser().parse_args(["bench", str(first), "--arm", "a=--io direct"])
    _check(args)  # a .gguf file is a model
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(BenchError, match="neither a model folder .* nor a .gguf file"):
        _check(cli.build_parser().parse_args(["bench", str(tmp_path / "notes.txt"), "--arm", "a=--io direct"]))
