"""`sluice bench`: arm parsing, rotation, pairing and identity arithmetic on synthetic numbers, the disk measurement
tool, cold verification and the cgroup checks, and one end-to-end run on a tiny model with its floor measured in
the run (the floor itself: test_floor.py)."""

from __future__ import annotations

import json
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from sluice.io.engines import URING_DEPTH, resolve_engine
from sluice import cli
from sluice.bench import BenchError
from sluice.bench import disk as diskmod
from sluice.bench.arms import context_for, parse_arm, parse_arms, sized_context
from sluice.bench.launch import model_files, prepare, run_child
from sluice.bench.protocol import (
    Run,
    identity,
    identity_text,
    pair,
    percentile,
    rotation,
    summarize,
    wins_text,
)
from sluice.bench.report import table
from sluice.commands import bench as bench_cmd
from sluice.io import residency
from sluice.io.residency import filesystem_type

from ..models.tiny import hf_model, write_checkpoint




@pytest.fixture(scope="module")
def disk_dir():
    """A folder on a disk-backed filesystem: page-cache residency means nothing on tmpfs."""
    folder = tempfile.mkdtemp(dir="/var/tmp", prefix="sluice-bench-test-")
    if filesystem_type(folder) in ("tmpfs", "ramfs", "overlay", ""):
        os.rmdir(folder)
        pytest.skip(f"/var/tmp is {filesystem_type(folder) or 'unknown'}, not a disk")
    yield Path(folder)
    for p in sorted(Path(folder).rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    os.rmdir(folder)


@pytest.fixture(scope="module")
def model_dir(disk_dir):
    return write_checkpoint(hf_model("qwen3_moe", torch.bfloat16), disk_dir / "tiny", "per_expert")


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


# --- arms -------------------------------------------------------------------------------------------------------


def test_arm_flags_are_run_flags():
    arm = parse_arm("direct=--io direct --memory 1GiB --io-workers 4 --odirect --dtype float32")
    assert arm.name == "direct"
    assert arm.options == {"io": "direct", "memory": "1GiB", "io_workers": 4, "odirect": True, "dtype": "float32"}
    assert parse_arm("base=").options == {}  # defaults stay LoadOptions'
    assert parse_arm("q='--io' 'mmap'").options == {"io": "mmap"}  # shell quoting inside FLAGS


@pytest.mark.parametrize("spec,needle", [
    ("x=--io direct --bogus 3", r"arm 'x'.*unrecognized arguments: --bogus 3"),
    ("y=--io floppy", r"arm 'y'.*invalid choice: 'floppy'"),
    ("z=--mem 1GiB", r"arm 'z'.*--mem"),  # no prefix abbreviations
    ("w=--memory lots", r"arm 'w'.*memory"),  # LoadOptions checks the value
    ("--io direct", r"expected NAME='FLAGS'"),
])
def test_bad_arm_is_a_clear_error(spec, needle):
    with pytest.raises(BenchError, match=needle):
        parse_arm(spec)


def test_replays_get_the_context_their_work_needs_unless_an_arm_sets_it():
    assert context_for(2048, 1) == 2065 and context_for(6, 8) == 512  # llama.cpp's n_ctx rule
    plain, own, peer = parse_arms(["a=--io direct", "b=--max-context 8192", "c=peer:llama.cpp"])
    assert sized_context(plain, 2065).options == {"io": "direct", "max_context": 2065}
    assert sized_context(own, 2065) == own and sized_context(peer, 2065) == peer


def test_arm_names_unique_and_required():
    with pytest.raises(BenchError, match="twice"):
        parse_arms(["a=--io mmap", "a=--io direct"])
    with pytest.raises(BenchError, match="at least one --arm"):
        parse_arms([])


# --- protocol arithmetic on synthetic numbers ------------------------------------------------------------------------


def test_rotation_puts_each_arm_in_each_position():
    names = ["a", "b", "c"]
    assert [rotation(names, r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    for pos in range(3):
        assert {rotation(names, r)[pos] for r in range(3)} == set(names)


def fake_run(arm: str, rnd: int, steps_ms: list[float], *, bytes_read: int = 0, hits: int = 0, misses: int = 0,
             argmax: list[int] | None = None) -> Run:
    n = len(steps_ms)
    window = {"steps": n, "hits": hits, "misses": misses, "bytes_read": bytes_read, "io_wait_s": 0.001 * n,
              "disk_read_bytes": 2 * bytes_read, "major_faults": 3 * n, "minor_faults": 10 * n,
              "cpu_s": 0.002 * n, "wall_s": sum(steps_ms) / 1000}
    record = {"ok": True, "step_s": [ms / 1000 for ms in steps_ms], "prefill_s": 0.5, "window": window,
              "peak_rss_bytes": 100 << 20, "argmax": argmax or [1, 2, 3], "stats": {"prefetch_recall": 0.5}}
    return Run(arm, rnd, 0, record=record)


def test_pairing_and_wins():
    runs = []
    for rnd, (ref_ms, b_ms) in enumerate([(10, 8), (10, 9), (10, 11), (20, 14)], start=1):
        runs += [fake_run("ref", rnd, [ref_ms - 1, ref_ms, ref_ms + 1]), fake_run("b", rnd, [b_ms] * 3)]
    runs.append(fake_run("ref", 5, [10.0] * 3))
    runs.append(Run("b", 5, 1, oom=True, error="OOM-killed under the memory ceiling"))  # round 5: no pair
    p = pair(runs, "ref", "b")
    assert p["ratios"] == pytest.approx({1: 0.8, 2: 0.9, 3: 1.1, 4: 0.7})
    assert (p["wins"], p["pairs"]) == (3, 4) and wins_text(p) == "3/4 paired"
    assert p["ratio_median"] == pytest.approx(0.85)
    assert p["ratio_p90"] == pytest.approx(percentile([0.8, 0.9, 1.1, 0.7], 90))
    s = summarize([r for r in runs if r.arm == "b"])
    assert (s["runs"], s["ok_runs"], s["oom_runs"]) == (5, 4, 1)
    assert s["step_ms_median"] == pytest.approx(10.0)  # every round pooled: 8 8 8 9 9 9 | 11 11 11 14 14 14
    assert s["step_ms_p90"] == pytest.approx(percentile([8] * 3 + [9] * 3 + [11] * 3 + [14] * 3, 90))
    assert s["major_faults_per_step"] == 3 and s["minor_faults_per_step"] == 10
    assert s["cpu_ms_per_step"] == pytest.approx(2.0) and s["io_wait_ms_per_step"] == pytest.approx(1.0)
    assert s["prefetch_recall"] == 0.5  # later counters of Model.stats() carried through


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)


def test_floor_in_the_summary():
    floor = {"before": {"floor_ms": 10.0, "prefill_floor_ms": 50.0}, "after": {"floor_ms": 7.5,
                                                                              "prefill_floor_ms": 60.0}}
    s = summarize([fake_run("a", 1, [30.0] * 4, bytes_read=4 * 10_000_000, hits=6, misses=2)], floor)
    assert s["bytes_read_per_step"] == 10_000_000 and s["disk_read_bytes_per_step"] == 20_000_000
    assert (s["floor_ms_before"], s["floor_ms_after"], s["floor_ms"]) == (10.0, 7.5, 7.5)
    assert s["step_floor_ratio"] == pytest.approx(4.0) and s["step_floor_before"] == pytest.approx(3.0)
    assert s["prefill_floor_ratio"] == pytest.approx(500 / 50)
    assert s["hit_rate"] == pytest.approx(0.75)
    assert summarize([fake_run("a", 1, [30.0])])["floor_ms"] is None  # not measured: no floor


def test_paired_floor_by_round():
    """--floor-each-round: each run's median step against the floor replayed right after it in its round."""
    floor = {"before": {"floor_ms": 10.0, "prefill_floor_ms": 50.0},
             "rounds": {"1": {"floor_ms": 20.0}, "2": {"floor_ms": 8.0}, "3": {"floor_ms": 12.0}}}
    runs = [fake_run("a", 2, [16.0, 17.0, 18.0]), fake_run("a", 1, [30.0] * 3), fake_run("a", 3, [12.0])]
    s = summarize(runs, floor)
    assert s["floor_ms_rounds"] == [20.0, 8.0, 12.0]  # round order
    assert s["step_floor_rounds"] == pytest.approx([1.5, 17 / 8, 1.0])
    assert s["step_floor_paired"] == pytest.approx(1.5)
    assert s["step_floor_ratio"] == pytest.approx(18 / 10)  # the strict ratio: all steps pooled, the faster floor
    assert "step_floor_paired" not in summarize(runs, {"before": {"floor_ms": 10.0}})  # no rounds: no field


def test_identity_gate_on_synthetic_argmax():
    runs = [fake_run("ref", 1, [1.0], argmax=[5, 6, 7, 8]), fake_run("same", 1, [1.0], argmax=[5, 6, 7, 8]),
            fake_run("other", 1, [1.0], argmax=[5, 6, 9, 8]), fake_run("other", 2, [1.0], argmax=[5, 6, 7])]
    g = identity(runs, "ref")
    assert not g["identical"] and g["reference"]["arm"] == "ref"
    assert g["arms"]["same"]["mismatched_steps"] == 0
    other = g["arms"]["other"]
    assert (other["runs_compared"], other["steps_compared"], other["mismatched_steps"]) == (2, 8, 2)
    assert other["first_mismatch"] == {"round": 1, "step": 2, "expected": 7, "got": 9}
    assert identity_text(g["arms"]["same"]) == "identical (4/4)"
    assert identity_text(other).startswith("2/8 differ (first: round 1 step 2)")
    assert identity([fake_run("b", 1, [1.0])], "ref")["reference"] is None  # nothing to compare with


# --- disk measurement -----------------------------------------------------------------------------------------------


def test_disk_measure_tool(disk_dir, cache_home):
    result = diskmod.measure(disk_dir, size=8 << 20, workers=(1, 4), chunks=(64 << 10,))
    assert len(result["results"]) == 2 * (1 + 2)  # buffered and O_DIRECT: sequential + random x 2 worker counts
    assert result["best_bytes_per_s"] == max(e["bytes_per_s"] for e in result["results"]) > 0
    assert result["cold_verified"]
    assert not list(disk_dir.glob(".sluice-disk-*"))  # the temporary file is gone
    path = diskmod.save(result)
    assert path == cache_home / "sluice" / f"disk-{os.stat(disk_dir).st_dev}.json"
    assert "| random 64.0 KiB | O_DIRECT |" in diskmod.table(result)


# --- residency and ceilings -----------------------------------------------------------------------------------------


def test_cold_fails_when_a_file_stays_mapped(model_dir, tmp_path, capsys):
    weights = model_dir / "model.safetensors"
    with open(weights, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        assert sum(mm[:: mmap.PAGESIZE]) >= 0  # touch every page: mapped pages survive eviction
        with pytest.raises(BenchError, match=r"not cold before x: \d+\.\d% of the model .*model\.safetensors \(100\.0%\)"):
            prepare(model_files(model_dir), "cold", "x")
        rc = cli.main(["bench", str(model_dir), "--arm", "a=", "--cold", "--no-floor", "--out", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "sluice bench: error: not cold" in err and "%" in err
    assert prepare(model_files(model_dir), "cold", "y")["resident_fraction"] <= 0.01  # unmapped: evicts fine


def test_ceiling_without_cgroups_is_a_clear_error(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(residency, "V2_ROOT", tmp_path / "no-cgroup-v2")
    monkeypatch.setattr(residency, "V1_ROOT", tmp_path / "no-cgroup-v1")
    rc = cli.main(["bench", str(model_dir), "--arm", "a=", "--ceiling", "1GiB", "--no-floor", "--out",
                   str(tmp_path / "out")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--ceiling needs a writable memory cgroup" in err and "no memory cgroup" in err
    assert "Traceback" not in err


def cgroup_problem() -> str | None:
    if os.geteuid() != 0:
        return "not root"
    try:
        residency.run_in_memory_cgroup(["/bin/true"], 64 << 20)
    except residency.ResidencyError as e:
        return str(e)
    return None


@pytest.mark.skipif(cgroup_problem() is not None, reason=f"no memory cgroup: {cgroup_problem()}")
def test_oom_kill_is_a_row_not_a_crash():
    hog = [sys.executable, "-c", "b = bytearray(512 << 20); b[::4096] = b'x' * len(b[::4096])"]
    got = run_child(hog, ceiling=64 << 20)
    assert got.oom_killed and got.error() == "OOM-killed under the memory ceiling"
    runs = [fake_run("ref", 1, [1.0]), Run("hog", 1, 1, error=got.error(), oom=True)]
    results = {"arms": [{"name": "ref"}, {"name": "hog"}],
               "summary": {"ref": summarize(runs[:1]), "hog": summarize(runs[1:])},
               "identity": identity(runs, "ref")}
    assert "| hog | OOM (1/1 rounds) |" in table(results)


# --- end to end -----------------------------------------------------------------------------------------------------


def budgets(model_dir: Path, capsys) -> tuple[str, str]:
    """--memory for a bf16 and a float32 arm that hold the resident weights and 6 of the 16 experts."""
    assert cli.main(["inspect", str(model_dir), "--json", "--usage-tokens", "0"]) == 0
    info = json.loads(capsys.readouterr().out)
    bf16 = info["resident_bytes"] + 6 * info["bytes_per_expert"]
    return str(bf16), str(2 * bf16)


def test_end_to_end_two_arms_cold(model_dir, tmp_path, cache_home, capsys, monkeypatch):
    bf16, f32 = budgets(model_dir, capsys)
    out = tmp_path / "out"
    warmup, steps = 3, 5
    generated: list[dict] = []  # the reference arm's generate run, sized like the replays
    child_argv = bench_cmd.child_argv
    monkeypatch.setattr(bench_cmd, "child_argv", lambda mode, model, options, **kw: (
        generated.append(options) if mode == "generate" else None, child_argv(mode, model, options, **kw))[1])
    children: list[str] = []  # every child in the order it ran: generate, replay, replay --journal, floor
    run = bench_cmd.run_child
    monkeypatch.setattr(bench_cmd, "run_child", lambda argv, *a, **k: (
        children.append(argv[3] + (" --journal" if "--journal" in argv else "")), run(argv, *a, **k))[1])
    rc = cli.main(["bench", str(model_dir), "--arm", f"ref=--io direct --memory {bf16}",
                   "--arm", f"f32=--io mmap --dtype float32 --memory {f32}", "--rounds", "2", "--steps", str(steps),
                   "--warmup", str(warmup), "--prompt-tokens", "6", "--cold", "--require-identical",
                   "--out", str(out)])
    captured = capsys.readouterr()
    assert rc in (0, 1), captured.err  # 1: the float32 arm's argmax may differ from bf16's (the gate's job)
    results = json.loads((out / "results.json").read_text())
    ident = results["identity"]
    assert rc == (0 if ident["identical"] else 1), captured.err

    # the table, on stdout and in results.md
    assert "| arm | ms/step | p90 | tok/s | vs ref | paired wins |" in captured.out
    assert "| ref (ref) |" in captured.out and "| f32 |" in captured.out and "/2 paired" in captured.out
    assert (out / "results.md").read_text().strip() == captured.out.strip()
    assert (out / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "cold: 0.00% of" in captured.err  # the residency figure is printed before each run

    # protocol: rotated order, fresh verified-cold child per run, warm-up excluded from timing
    runs = [Run(**r) for r in results["runs"]]
    assert [(r.round, r.arm) for r in runs] == [(1, "ref"), (1, "f32"), (2, "f32"), (2, "ref")]
    assert all(r.ok and r.residency["state"] == "cold" and r.residency["resident_fraction"] <= 0.01 for r in runs)
    for r in runs:
        rec = r.record
        assert len(rec["step_s"]) == steps and len(rec["warmup_step_s"]) == warmup
        assert len(rec["argmax"]) == warmup + steps + 1 and rec["window"]["steps"] == steps
        assert sum(rec["step_bytes_read"]) == rec["window"]["bytes_read"]
        # the prefill read its touched experts (the disk's share is smaller on a tiny model: the resident weights'
        # reads at load bring neighbouring expert pages in through readahead)
        assert rec["prefill_tokens"] == 6 and rec["prefill_bytes_read"] > 0 and rec["prefill_disk_read_bytes"] >= 0
        # the prefill's own counters: a cold mmap arm faults its first pages in; CPU time was spent
        assert rec["prefill_major_faults"] >= 0 and rec["prefill_cpu_s"] > 0
    assert len(results["sequence"]["tokens"]) == warmup + steps and len(results["sequence"]["prompt_ids"]) == 6

    # identity gate: the float32 arm compared step by step with the bf16 reference (counts match the arrays)
    ref_argmax = runs[0].record["argmax"]
    differ = sum(a != b for r in runs if r.arm == "f32" for a, b in zip(ref_argmax, r.record["argmax"]))
    assert ident["arms"]["f32"]["runs_compared"] == 2
    assert ident["arms"]["f32"]["steps_compared"] == 2 * (warmup + steps + 1)
    assert ident["arms"]["f32"]["mismatched_steps"] == differ

    # the replays' KV cache is sized to the work, as the llama.cpp arm's n_ctx (arms.sized_context)
    assert results["meta"]["context"] == 512 and all(a["options"]["max_context"] == 512 for a in results["arms"])
    assert [o["max_context"] for o in generated] == [512]
    assert "a KV cache of 512 positions" in captured.out

    # metrics
    s = results["summary"]
    assert s["ref"]["step_ms_median"] > 0 and s["ref"]["tok_s"] > 0 and s["ref"]["peak_rss_bytes"] > 0
    assert s["ref"]["bytes_read_per_step"] > 0  # 6 of 16 experts cached: some steps miss
    assert s["ref"]["prefill_tok_s"] > 0 and s["ref"]["prefill_read_bytes"] > 0
    assert "| prefill ms | prefill tok/s | prefill read |" in captured.out
    assert s["f32"]["pair"]["pairs"] == 2

    # the floor, measured in this run: each arm's reads recorded once, replayed cold before round 1 and after round 2
    assert children == ["generate", "replay --journal", "replay --journal", "floor", "floor",
                        "replay", "replay", "replay", "replay", "floor", "floor"]
    floor = results["floor"]
    engine = resolve_engine("auto")  # the default expert reader: the io_uring where allowed, 16 reads in flight there
    assert floor["ref"]["plan_summary"]["readers"] == [{"mode": "direct", "odirect": False, "engine": engine,
                                                         "workers": URING_DEPTH if engine == "uring" else 8}]
    assert floor["f32"]["plan_summary"]["readers"][0]["mode"] == "mmap"
    for name in ("ref", "f32"):
        f, sm = floor[name], s[name]
        assert not f["errors"] and f["plan_summary"]["timed_steps"] == steps
        for when in ("before", "after"):
            assert f[when]["residency"]["state"] == "cold" and f[when]["residency"]["resident_fraction"] <= 0.01
            assert f[when]["resident_before"] <= 0.01 and f[when]["floor_ms"] >= 0
            assert sm[f"floor_ms_{when}"] == f[when]["floor_ms"]
        assert sm["floor_ms"] == min(f["before"]["floor_ms"], f["after"]["floor_ms"])
    ref = s["ref"]
    assert ref["floor_ms"] > 0 and ref["step_floor_ratio"] == pytest.approx(ref["step_ms_median"] / ref["floor_ms"])
    # the plan read what the arm's rounds read, per timed step (the store's count, plus gaps read through)
    assert floor["ref"]["plan_summary"]["bytes_per_step"] >= ref["bytes_read_per_step"] > 0
    assert "| floor ms before / after | step/floor |" in captured.out
    assert f"| {ref['floor_ms_before']:.2f} / {ref['floor_ms_after']:.2f} |" in captured.out
    assert "I/O floor measured in this run, before the first round and after the last" in captured.out
    reader = {"uring": f"{URING_DEPTH} reads in flight, io_uring", "native": "8 workers, native threads",
              "python": "8 workers, python threads"}[engine]
    assert f"| ref | direct, {reader}, buffered |" in captured.out and "| f32 | mmap |" in captured.out
    assert not (cache_home / "sluice").exists()  # no cached disk figure was read or written


def test_floor_each_round_without_the_floor_is_a_clear_error(model_dir, tmp_path, capsys):
    rc = cli.main(["bench", str(model_dir), "--arm", "a=", "--no-floor", "--floor-each-round", "--out",
                   str(tmp_path)])
    assert rc != 0 and "--floor-each-round replays each arm's reads, which --no-floor skips" in capsys.readouterr().err


def test_end_to_end_floor_each_round(model_dir, tmp_path, cache_home, capsys, monkeypatch):
    """Each round's run is followed by its own floor replay; the floor table gains the paired ratios."""
    bf16, _ = budgets(model_dir, capsys)
    out = tmp_path / "out"
    children: list[str] = []
    run = bench_cmd.run_child
    monkeypatch.setattr(bench_cmd, "run_child", lambda argv, *a, **k: (
        children.append(argv[3] + (" --journal" if "--journal" in argv else "")), run(argv, *a, **k))[1])
    rc = cli.main(["bench", str(model_dir), "--arm", f"ref=--io direct --memory {bf16}", "--rounds", "2",
                   "--steps", "3", "--warmup", "1", "--prompt-tokens", "6", "--cold", "--floor-each-round",
                   "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert children == ["generate", "replay --journal", "floor", "replay", "floor", "replay", "floor", "floor"]
    results = json.loads((out / "results.json").read_text())
    f, s = results["floor"]["ref"], results["summary"]["ref"]
    assert sorted(f["rounds"]) == ["1", "2"]
    assert all(m["residency"]["state"] == "cold" and m["floor_ms"] > 0 for m in f["rounds"].values())
    runs = {r["round"]: Run(**r) for r in results["runs"]}
    want = [sorted(runs[k].step_ms())[1] / f["rounds"][str(k)]["floor_ms"] for k in (1, 2)]  # 3 steps: the middle
    assert s["step_floor_rounds"] == pytest.approx(want)
    assert "step/floor paired by round (floor ms) |" in captured.out and "Paired: each round's run" in captured.out
    assert f"**{s['step_floor_paired']:.2f}** (" in captured.out


def test_source_commit_ignores_result_folders(tmp_path):
    """A run that writes result folders still names its source commit clean; a changed source file makes it dirty;
    outside a git checkout there is no commit."""
    import subprocess

    from sluice.commands.bench import source_commit

    def git(*a):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.email=t@t", "-c", "user.name=t", *a], check=True,
                       capture_output=True)

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "r.md").write_text("old\n")
    (tmp_path / "src.py").write_text("x = 1\n")
    assert source_commit(tmp_path) is None
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "init")
    clean = source_commit(tmp_path)
    assert clean and "+dirty" not in clean
    (tmp_path / "benchmarks" / "results" / "r.md").write_text("new\n")
    assert source_commit(tmp_path) == clean
    (tmp_path / "src.py").write_text("x = 2\n")
    assert source_commit(tmp_path) == clean + "+dirty"


@pytest.mark.parametrize("ceiling", [None, 64 << 20])
def test_a_run_past_its_timeout_is_killed_and_reported(ceiling):
    """--run-timeout: a child still going is killed (its cgroup with it under a ceiling) and becomes a row saying
    so, not a hang of the whole bench (a llama.cpp arm thrashing under a ceiling read 500 GB in 11 minutes)."""
    if ceiling is not None and cgroup_problem() is not None:
        pytest.skip(f"no memory cgroup: {cgroup_problem()}")
    t0 = time.perf_counter()
    got = run_child([sys.executable, "-c", "import time; time.sleep(60)"], ceiling=ceiling, timeout=0.5)
    assert time.perf_counter() - t0 < 30
    assert got.timed_out == 0.5 and got.record is None
    assert got.error() == "killed after 0.5 s (--run-timeout): it had not finished"


def test_run_timeout_must_be_positive(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    for bad in ("0", "-1", "nan"):
        assert cli.main(["bench", str(tmp_path), "--arm", "a=--io mmap", "--run-timeout", bad]) != 0
        assert f"--run-timeout must be > 0 seconds, got {float(bad)}" in capsys.readouterr().err
