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


# --- llama.cpp's defaults first, repacking off only when they crash ---------------------------------------------------


def test_repacking_is_llama_cpps_default_unless_turned_off():
    from sluice.bench.peers import crash_signal, repacking_off

    default = parse_arm("l=peer:llama.cpp").options
    assert default["extra_bufts"] is None  # the child leaves llama.cpp's use_extra_bufts alone
    assert parse_arm("n=peer:llama.cpp --no-extra-bufts").options["extra_bufts"] is False
    assert repacking_off("llama.cpp", default) == {**default, "extra_bufts": False}
    assert repacking_off("llama.cpp", {**default, "extra_bufts": False}) is None  # nothing left to fall back to
    assert repacking_off("accelerate", {}) is None and repacking_off(None, {}) is None
    assert crash_signal(-4, False) == "SIGILL" and crash_signal(-11, False) == "SIGSEGV"
    assert crash_signal(-9, True) is None  # an OOM kill is the ceiling's result, not a crash
    assert crash_signal(-15, False) is None and crash_signal(2, False) is None and crash_signal(0, False) is None


def test_peer_child_sets_use_extra_bufts_only_when_asked():
    import runpy
    from types import SimpleNamespace

    with_extra_bufts = runpy.run_path(str(CHILD))["with_extra_bufts"]
    defaults = lambda: SimpleNamespace(use_extra_bufts=True, use_mmap=True)  # noqa: E731
    assert with_extra_bufts(defaults, None) is defaults  # llama.cpp's own defaults, untouched
    off = with_extra_bufts(defaults, False)()
    assert off.use_extra_bufts is False and off.use_mmap is True
    old = with_extra_bufts(lambda: SimpleNamespace(use_mmap=True), False)()  # a llama.cpp without the field
    assert not hasattr(old, "use_extra_bufts")


CRASHING = '''#!{python}
"""Stands in for the peers' interpreter running llama.cpp: on a GGUF named crash*.gguf its defaults die of SIGILL (as
the repacked AMX kernels did on one CPU); with repacking off they run. exit2*.gguf fails cleanly (exit status 2)."""
import json, os, resource, signal, sys
argv = sys.argv[2:]
opt = lambda k: argv[argv.index(k) + 1]
opts = json.loads(opt("--options"))
name = os.path.basename(opts["gguf"])
with open({log!r}, "a") as f:
    f.write(json.dumps([name, opts.get("extra_bufts")]) + "\\n")
if name.startswith("crash") and opts.get("extra_bufts") is not False:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file left behind
    os.kill(os.getpid(), signal.SIGILL)
if name.startswith("exit2"):
    print(json.dumps({{"ok": False, "error": "llama.cpp: OSError: cannot load"}}))
    sys.exit(2)
work, warmup = json.load(open(opt("--work"))), int(opt("--warmup"))
tokens = work["tokens"]
ms = {{"crash.gguf": 0.03, "fine.gguf": 0.02}}.get(name, 0.01)  # crash2.gguf: 10 ms
steps = [ms] * len(tokens)
used = opts.get("extra_bufts") is not False  # llama.cpp's default is on
print(json.dumps({{"ok": True, "argmax": tokens + [0], "load_s": 0.1, "prefill_s": 0.2 if used else 0.4,
    "prefill_tokens": len(work["prompt_ids"]), "warmup_step_s": steps[:warmup], "step_s": steps[warmup:],
    "window": {{"disk_read_bytes": 0, "major_faults": 0, "minor_faults": 0, "cpu_s": 0.1, "wall_s": 0.1,
                "steps": len(steps[warmup:]), "hits": 0, "misses": 0}},
    "peak_rss_bytes": 1 << 20, "stats": {{}},
    "peer": {{"kind": "llama.cpp", "settings": {{"use_extra_bufts": used}}}}}}))
'''


def test_llama_cpp_falls_back_to_repacking_off_only_when_its_defaults_crash(model_dir, disk_dir, tmp_path, capsys):
    bf16, _ = budgets(model_dir, capsys)
    log = tmp_path / "calls.jsonl"
    fake = tmp_path / "peer-python"
    fake.write_text(CRASHING.format(python=sys.executable, log=str(log)))
    fake.chmod(0o755)
    ggufs = {n: disk_dir / f"{n}.gguf" for n in ("crash", "crash2", "fine", "exit2")}
    for p in ggufs.values():
        p.write_bytes(b"GGUF")
    out = tmp_path / "out"
    rc = cli.main(["bench", str(model_dir), "--arm", f"ref=--io direct --memory {bf16}",
                   "--arm", f"llama.cpp=peer:llama.cpp --gguf {ggufs['crash']}",
                   "--arm", f"norepack=peer:llama.cpp --no-extra-bufts --gguf {ggufs['crash2']}",
                   "--arm", f"fine=peer:llama.cpp --gguf {ggufs['fine']}",
                   "--arm", f"broken=peer:llama.cpp --gguf {ggufs['exit2']}",
                   "--peer-python", str(fake), "--rounds", "2", "--steps", "2", "--warmup", "1",
                   "--prompt-tokens", "4", "--no-floor", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 1, captured.err  # the broken arm failed; nothing else did
    calls = [tuple(json.loads(line)) for line in log.read_text().splitlines()]
    # the defaults are tried first; after they died once, that arm runs with repacking off; nothing else is retried
    assert calls.count(("crash.gguf", None)) == 1 and calls.count(("crash.gguf", False)) == 2
    assert calls.count(("crash2.gguf", False)) == 2 and ("crash2.gguf", None) not in calls
    assert calls.count(("fine.gguf", None)) == 2 and calls.count(("exit2.gguf", None)) == 2
    assert calls.index(("crash.gguf", None)) < calls.index(("crash.gguf", False))
    assert "llama.cpp's defaults died of SIGILL; running it again with repacking off" in captured.err

    results = json.loads((out / "results.json").read_text())
    runs = {(r["arm"], r["round"]): r for r in results["runs"]}
    assert all(runs[("llama.cpp", rnd)]["error"] is None for rnd in (1, 2))
    first = runs[("llama.cpp", 1)]["extra"]
    assert first["crashed"]["signal"] == "SIGILL" and first["crashed"]["options"]["extra_bufts"] is None
    assert first["fallback"] == {"signal": "SIGILL", "round": 1}
    assert runs[("llama.cpp", 2)]["extra"] == {"fallback": {"signal": "SIGILL", "round": 1}}
    assert runs[("fine", 1)]["extra"] == {} and runs[("broken", 1)]["error"] == "llama.cpp: OSError: cannot load"
    s = results["summary"]
    assert "died of SIGILL in round 1" in s["llama.cpp"]["repacking"]
    assert s["norepack"]["repacking"] == "repacking off (--no-extra-bufts)"
    assert s["fine"]["repacking"] == "llama.cpp's defaults (repacked CPU buffers on)"
    assert "repacking" not in s["ref"]
    # the best of the llama.cpp arms, at decode and at the prompt, and sluice's best against it
    best = results["peers"]["llama.cpp"]
    assert best["arms"] == ["llama.cpp", "norepack", "fine"]
    assert best["decode"]["arm"] == "norepack" and best["decode"]["step_ms"] == pytest.approx(10.0)
    assert best["decode"]["sluice_vs_best"] == pytest.approx(10.0 / s["ref"]["step_ms_median"])
    assert best["prefill"]["arm"] == "fine"  # the defaults' prompt (0.2 s) beat repacking off (0.4 s)
    assert "| llama.cpp (defaults crashed: repacking off) |" in captured.out
    assert "Best llama.cpp arm of 3 (llama.cpp, norepack, fine): decode **norepack** 10.00 ms/step" in captured.out
    assert "**fine** llama.cpp's defaults (repacked CPU buffers on)" in captured.out


def test_a_madvise_arm_is_named_with_its_madvise():
    """The note of an arm that madvises the mapping says so beside its repacking (it was labelled plain
    "llama.cpp's defaults" before)."""
    from types import SimpleNamespace

    from sluice.bench.peers import repacking_note

    run = SimpleNamespace(extra={}, ok=True, record={"peer": {"settings": {"use_extra_bufts": True}}})
    assert repacking_note("llama.cpp", {"madvise": "random"}, [run]) == \
        "llama.cpp's defaults (repacked CPU buffers on), MADV_RANDOM on the mapping"
    assert repacking_note("llama.cpp", {"extra_bufts": False}, [run]) == "repacking off (--no-extra-bufts)"
    assert repacking_note("accelerate", {"madvise": "random"}, [run]) is None
