"""`sluice bench MODEL --arm NAME='FLAGS' ...`: paired, replayed, cold-verified A/B runs, reported against the I/O
floor measured in the same run; `sluice bench --disk PATH`: a table of the disk's bandwidth by access pattern.

Protocol (DESIGN.md "Measuring"): the first arm generates the token sequence once in its own process; then in every
round every arm, in rotated order, replays that sequence (teacher forcing) in a fresh process: `--warmup` untimed
decode steps, then `--steps` timed ones. Each replayed argmax is checked against the reference arm's.

The floor (bench/floor.py): before the rounds, each sluice arm replays the sequence once more, untimed, recording its
read plan (the file ranges its readers read, per step); that plan is replayed cold with readers made like the arm's
before the first round and after the last, and step times are reported against both; with --floor-each-round also
right after the arm's run in every round, each run's step time against that round's floor (paired).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..bench import BenchError
from ..bench import disk as diskmod
from ..bench.arms import Arm, context_for, parse_arms, sized_context
from ..bench.floor import describe_plan
from ..bench.launch import arm_argv, check_ceiling, child_argv, model_files, prepare, run_child
from ..bench.peers import check_peer, crash_signal, peer_files, repacking_note, repacking_off
from ..bench.protocol import Run, best_of_peers, identity, pair, rotation, summarize
from ..bench.report import markdown, write_all
from ..errors import OutputError
from ..host.cpus import describe_cpu
from ..units import format_bytes, parse_size
from ..sampling import SEED_MIN, SEED_MAX

DEFAULT_PROMPT_TOKENS = 32  # a prompt of seeded random ids works for every model, tokenizer or not


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", metavar="MODEL", help="Hugging Face model folder (not needed with --disk)")
    p.add_argument("--arm", action="append", default=[], metavar="NAME='FLAGS'",
                   help="an arm: a name and `sluice run` loading flags, e.g. direct='--io direct --memory 2GiB' "
                        "(repeatable; the first is the reference). Unless --prompt is given, an arm without "
                        "--max-context gets prompt + warmup + steps + 16 KV positions, as the llama.cpp arm's n_ctx")
    p.add_argument("--rounds", type=int, default=5, help="rounds; each runs every arm once, order rotated (5)")
    p.add_argument("--steps", type=int, default=60, help="timed decode steps per run (60)")
    p.add_argument("--warmup", type=int, default=20, help="untimed decode steps before the timed ones (20)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt", metavar="TEXT", help="prompt text (needs the model's tokenizer)")
    g.add_argument("--prompt-tokens", type=int, metavar="N", help="a prompt of N seeded random ids (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="sample the reference sequence (0 = greedy)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler and of the random prompt (0)")
    c = p.add_mutually_exclusive_group()
    c.add_argument("--cold", action="store_true", help="evict the model before each run; verify <= 1%% resident")
    c.add_argument("--warm", action="store_true", help="read the model into the page cache before each run")
    p.add_argument("--ceiling", metavar="SIZE",
                   help="run each child in a memory cgroup of SIZE, page cache included (needs root)")
    p.add_argument("--run-timeout", metavar="SECONDS", type=float,
                   help="kill a timed run still going after SECONDS and report it as timed out (default: none; a "
                        "peer thrashing under a ceiling can take hours)")
    p.add_argument("--out", metavar="DIR", help="results.md, results.json, latency.png (./bench-out/<timestamp>)")
    p.add_argument("--require-identical", action="store_true",
                   help="exit 1 if any arm's argmax differs from the reference's at any replayed step")
    p.add_argument("--no-floor", action="store_true",
                   help="report no I/O floor (skips each sluice arm's untimed recording replay and the floor replays "
                        "of its reads before the first round and after the last)")
    p.add_argument("--floor-each-round", action="store_true",
                   help="also replay each sluice arm's reads right after its run in every round, and report its "
                        "step time against that round's floor (paired: the disk at the same moment), besides the "
                        "floors before the first round and after the last")
    p.add_argument("--disk", metavar="PATH",
                   help="measure the disk holding PATH by access pattern, print the table, save it, and exit (a "
                        "separate tool: the bench's floor replays each arm's own reads instead)")
    p.add_argument("--peer-python", metavar="PATH",
                   help="interpreter of the peers' environment, for `peer:llama.cpp` / `peer:accelerate` arms "
                        "(bash benchmarks/peers/setup.sh makes benchmarks/peers/.venv/bin/python)")
    p.add_argument("--disk-size", metavar="SIZE", default="1GiB",
                   help="--disk: size of the temporary file it reads (1GiB)")


def _log(msg: str) -> None:
    tqdm.write(msg, file=sys.stderr)  # above the progress bar, which it would otherwise tear


def disk_main(args: argparse.Namespace) -> int:
    """`sluice bench --disk PATH`: measure now, save the result, print the table."""
    result = diskmod.measure(args.disk, parse_size(args.disk_size, "disk-size"), log=_log)
    path = diskmod.save(result)
    print(diskmod.table(result))
    _log(f"saved in {path}")
    return 0


def _check(args: argparse.Namespace) -> None:
    if args.model is None:
        raise BenchError("give MODEL and at least one --arm, or --disk PATH")
    model = Path(args.model)
    if not ((model / "config.json").is_file() or (model.is_file() and model.suffix == ".gguf")):
        raise BenchError(f"{args.model}: neither a model folder (no config.json) nor a .gguf file")
    for name, low in (("rounds", 1), ("steps", 1), ("warmup", 0)):
        if getattr(args, name) < low:
            raise BenchError(f"--{name} must be >= {low}, got {getattr(args, name)}")
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        raise BenchError(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}")
    if args.run_timeout is not None and not args.run_timeout > 0:  # not > 0: NaN too
        raise BenchError(f"--run-timeout must be > 0 seconds, got {args.run_timeout}")
    if not SEED_MIN <= args.seed <= SEED_MAX:
        raise BenchError(f"--seed must be in [-2**63, 2**64 - 1] (64 bits), got {args.seed}")
    if args.floor_each_round and args.no_floor:
        raise BenchError("--floor-each-round replays each arm's reads, which --no-floor skips: give one of them")


def _residency_line(res: dict[str, Any] | None, what: str) -> str | None:
    if res is None:
        return None
    worst = max(res["files"].values(), default=0.0)
    return (f"{res['state']}: {res['resident_fraction']:.2%} of {format_bytes(res['bytes'])} resident before {what} "
            f"(largest file {worst:.2%})")


class Bench:
    """One `sluice bench` invocation: its arms, conditions and the runs collected so far."""

    def __init__(self, args: argparse.Namespace, arms: list[Arm], ceiling: int | None):
        self.args, self.arms, self.ceiling = args, arms, ceiling
        # peers' own files (llama.cpp's GGUF) are evicted and verified cold with the model's
        extra = [f for a in arms if a.peer for f in peer_files(a.peer, a.options, args.model)]
        self.files = sorted({f.resolve() for f in [*model_files(args.model), *extra]})
        self.page_cache = "cold" if args.cold else "warm" if args.warm else None
        self.runs: list[Run] = []
        # per sluice arm: its read plan and the floor measured from it before the first round and after the last
        self.floor: dict[str, dict[str, Any]] = {}
        # llama.cpp arms whose defaults crashed on this machine: the signal, the round, the options run since
        self.fallbacks: dict[str, dict[str, Any]] = {}
        self.with_floor = not args.no_floor
        self.floor_each_round = args.floor_each_round
        floors = (3 + (args.rounds if self.floor_each_round else 0)) * sum(a.peer is None for a in arms) \
            if self.with_floor else 0  # plan, before, after (and one a round)
        # KV positions of every sluice arm without --max-context (arms.sized_context; None: a text --prompt, whose
        # length the tokenizer decides, keeps the default)
        self.context: int | None = None
        self.progress = tqdm(total=1 + args.rounds * len(arms) + floors, unit="run", file=sys.stderr,
                             disable=None, desc="bench")

    def _prepare(self, what: str) -> dict[str, Any] | None:
        res = prepare(self.files, self.page_cache, what)
        line = _residency_line(res, what)
        if line:
            _log(line)
        return res

    def reference_sequence(self) -> dict[str, Any]:
        """Prompt ids and tokens generated once by the reference arm, in a child like every other run."""
        a, ref = self.args, self.arms[0]
        self.progress.set_description(f"generating with {ref.name}")
        self._prepare(f"generating with arm {ref.name!r}")
        prompt_tokens = None if a.prompt is not None else a.prompt_tokens or DEFAULT_PROMPT_TOKENS
        argv = child_argv("generate", a.model, ref.options, tokens=a.warmup + a.steps, prompt=a.prompt,
                          prompt_tokens=prompt_tokens, temperature=a.temperature, seed=a.seed)
        got = run_child(argv, self.ceiling)
        self.progress.update()
        if got.error() is not None:
            raise BenchError(f"the reference arm {ref.name!r} could not generate the sequence: {got.error()}"
                             + (f"\n{got.stderr_tail}" if got.returncode not in (0, 2) and not got.oom_killed
                                else ""))
        return got.record

    def record_plans(self, work: Path, folder: Path) -> None:
        """Each sluice arm replays the work once, untimed, under the same ceiling, recording its read plan (what its
        readers read, per step) into `folder`/plan-<arm>.json."""
        for arm in self.arms:
            if arm.peer is not None:
                continue
            self.progress.set_description(f"recording the reads of {arm.name}")
            argv = arm_argv(arm, "replay", self.args.model, work=work, warmup=self.args.warmup, journal=True)
            got = run_child(argv, self.ceiling)
            self.progress.update()
            entry = self.floor.setdefault(arm.name, {"errors": [], "oom": []})
            if got.error() is not None:  # an OOM kill is the arm's own result under the ceiling, not an error
                entry["oom" if got.oom_killed else "errors"].append(f"recording its reads: {got.error()}")
                _log(f"floor of arm {arm.name!r}: recording its reads failed: {got.error()}")
                continue
            plan = got.record["plan"]
            (folder / f"plan-{arm.name}.json").write_text(json.dumps(plan))
            entry.update(plan=plan, plan_summary=describe_plan(plan))

    def measure_floors(self, when: str, folder: Path) -> None:
        """The floor of every arm with a plan, `when` ("before" the rounds or "after"): its plan replayed in a
        fresh child under the ceiling, the files evicted and verified cold first (warm for a --warm bench)."""
        for name, entry in self.floor.items():
            got = self.measure_floor(name, entry, when, folder)
            if got is not None:
                entry[when] = got

    def measure_floor(self, name: str, entry: dict[str, Any], when: str, folder: Path) -> dict[str, Any] | None:
        """One floor of arm `name` (its entry in self.floor: errors and OOM kills are noted there); None when it has
        no plan or the replay failed."""
        if "plan" not in entry:
            return None
        what = f"the floor of arm {name!r} ({when})"
        self.progress.set_description(f"floor {when}: {name}")
        if not entry["plan"]["prefill"] and not any(entry["plan"]["steps"]):  # resident: nothing to replay
            self.progress.update()
            return {"ok": True, "floor_ms": 0.0, "prefill_floor_ms": 0.0, "bytes_per_s": None,
                    "skipped": "the arm read nothing"}
        state = "warm" if self.page_cache == "warm" else "cold"
        try:
            res = prepare(self.files, state, what)
        except BenchError as e:
            entry["errors"].append(f"{when}: {e}")
            _log(f"{what}: {e}")
            self.progress.update()
            return None
        line = _residency_line(res, what)
        if line:
            _log(line)
        argv = child_argv("floor", self.args.model, {}, plan=folder / f"plan-{name}.json")
        got = run_child(argv, self.ceiling)
        self.progress.update()
        if got.error() is not None:
            entry["oom" if got.oom_killed else "errors"].append(f"{when}: {got.error()}")
            _log(f"{what}: {got.error()}")
            return None
        f = got.record["floor_ms"]
        _log(f"{what}: {'-' if f is None else f'{f:.2f}'} ms/step, prompt {got.record['prefill_floor_ms']:.1f} ms")
        return {**got.record, "residency": res, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    def _replay(self, arm: Arm, what: str, work: Path):
        res = self._prepare(what)
        argv = arm_argv(arm, "replay", self.args.model, self.args.peer_python, work=work, warmup=self.args.warmup)
        return res, run_child(argv, self.ceiling, self.args.run_timeout)

    def replay_round(self, rnd: int, work: Path) -> None:
        """Every arm once, in this round's rotated order, each in a fresh child. A llama.cpp arm on llama.cpp's
        defaults whose child crashes is run again with repacking off, and so in every later round (peers.py)."""
        by_name = {arm.name: arm for arm in self.arms}
        for pos, name in enumerate(rotation(list(by_name), rnd - 1)):
            what = f"arm {name!r} round {rnd}"
            self.progress.set_description(f"round {rnd}/{self.args.rounds} {name}")
            arm, fallback, extra = by_name[name], self.fallbacks.get(name), {}
            if fallback is not None:
                arm = dataclasses.replace(arm, options=fallback["options"])
            res, got = self._replay(arm, what, work)
            sig = crash_signal(got.returncode, got.oom_killed) if got.timed_out is None else None
            off = repacking_off(arm.peer, arm.options) if sig else None
            if off is not None:
                _log(f"{what}: llama.cpp's defaults died of {sig}; running it again with repacking off "
                     "(use_extra_bufts=False), as in every later round")
                fallback = self.fallbacks[name] = {"signal": sig, "round": rnd, "options": off}
                extra["crashed"] = {"signal": sig, "options": arm.options, "wall_s": round(got.wall_s, 3),
                                    "stderr_tail": got.stderr_tail[-2000:]}
                res, got = self._replay(dataclasses.replace(arm, options=off), f"{what} (repacking off)", work)
            if fallback is not None:
                extra["fallback"] = {"signal": fallback["signal"], "round": fallback["round"]}
            err = got.error()
            run = Run(name, rnd, pos, record=got.record if err is None else None, error=err, oom=got.oom_killed,
                      residency=res, cgroup_peak_bytes=got.cgroup_peak_bytes, wall_s=round(got.wall_s, 3),
                      extra=extra)
            self.runs.append(run)
            if err is not None:
                _log(f"{what}: {err}")
            else:
                ms = run.step_ms()
                self.progress.set_postfix_str(f"{name} {sorted(ms)[len(ms) // 2]:.2f} ms/step")
            self.progress.update()
            if self.floor_each_round and arm.peer is None and name in self.floor:  # the disk at this moment
                got = self.measure_floor(name, self.floor[name], f"round {rnd}", work.parent)
                if got is not None:
                    self.floor[name].setdefault("rounds", {})[str(rnd)] = got

    def results(self, sequence: dict[str, Any]) -> dict[str, Any]:
        a = self.args
        ref = self.arms[0].name
        summary = {}
        for arm in self.arms:
            runs = [r for r in self.runs if r.arm == arm.name]
            s = summarize(runs, self.floor.get(arm.name))
            note = repacking_note(arm.peer, arm.options, runs)
            if note is not None:
                s["repacking"] = note
            if arm.name != ref:
                s["pair"] = pair(self.runs, ref, arm.name)
            summary[arm.name] = s
        return {
            "meta": {
                "model": str(a.model), "rounds": a.rounds, "steps": a.steps, "warmup": a.warmup,
                "prompt": a.prompt, "prompt_tokens": len(sequence["prompt_ids"]), "temperature": a.temperature,
                "seed": a.seed, "page_cache": self.page_cache, "ceiling": self.ceiling, "context": self.context,
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
                "cpus": os.cpu_count(), "cpu": describe_cpu(), "commit": source_commit(),
                "python": platform.python_version(),
                "peer_python": a.peer_python,
            },
            "floor": self.floor if self.with_floor else None,
            "arms": [arm.to_json() for arm in self.arms],
            "sequence": {"prompt_ids": sequence["prompt_ids"], "tokens": sequence["tokens"]},
            "runs": [r.to_json() for r in self.runs],
            "summary": summary,
            "peers": best_of_peers([arm.to_json() for arm in self.arms], summary),
            "identity": identity(self.runs, ref),
        }


def source_commit(root: Path | None = None) -> str | None:
    """The git commit of the sluice source that runs (short, "+dirty" when tracked files differ), or None outside a
    git checkout: what a committed result names beside its command. Files under benchmarks/results do not count:
    a run that writes several result folders would otherwise name its own earlier output as a change."""
    import subprocess

    root = root or Path(__file__).resolve().parent.parent.parent

    def git(*a: str) -> str:
        try:
            cmd = ["git", "-C", str(root), *a]
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
    return head + ("+dirty" if dirty else "") if head else None


def main(args: argparse.Namespace) -> int:
    if args.disk:
        return disk_main(args)
    _check(args)
    arms = parse_arms(args.arm)
    if arms[0].peer is not None:
        raise BenchError(f"the first arm is the reference and must be a sluice arm, not the peer {arms[0].name!r}: "
                         "it draws the prompt and generates the sequence every arm replays")
    for arm in arms:
        if arm.peer is not None:
            check_peer(arm.peer, arm.options, args.model, args.peer_python)
    ceiling = parse_size(args.ceiling, "ceiling") if args.ceiling else None
    if ceiling is not None:
        check_ceiling(ceiling)  # before anything runs: no cgroup is a setup error, not a per-arm result
    out = Path(args.out) if args.out else Path("bench-out") / time.strftime("%Y%m%d-%H%M%S")
    context = None
    if args.prompt is None:  # the prompt's length is known before anything runs: the reference arm runs sized too
        context = context_for(args.prompt_tokens or DEFAULT_PROMPT_TOKENS, args.warmup + args.steps)
        arms = [sized_context(arm, context) for arm in arms]
    bench = Bench(args, arms, ceiling)
    bench.context = context
    try:
        sequence = bench.reference_sequence()
        with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
            work = Path(tmp) / "sequence.json"
            work.write_text(json.dumps({"prompt_ids": sequence["prompt_ids"], "tokens": sequence["tokens"]}))
            if bench.with_floor:
                bench.record_plans(work, Path(tmp))
                bench.measure_floors("before", Path(tmp))
            for rnd in range(1, args.rounds + 1):
                bench.replay_round(rnd, work)
            if bench.with_floor:
                bench.measure_floors("after", Path(tmp))
    finally:
        bench.progress.close()
    results = bench.results(sequence)
    print(markdown(results), end="")
    try:
        paths = write_all(results, out)
    except OSError as e:
        raise OutputError(out, e, "the files were not written (none is left half-written); the table above on "
                                  "stdout is the result") from e
    _log(f"wrote {paths['md']}, {paths['json']}, {paths['png']}")
    return _exit_status(results, args.require_identical)


def _exit_status(results: dict[str, Any], require_identical: bool) -> int:
    """1 when an arm failed other than by OOM, or its floor could not be measured (numbers are missing), or when
    --require-identical and any replayed argmax differs from the reference (or nothing could be compared); else 0."""
    rc = 0
    for name, s in results["summary"].items():
        if s["errors"]:
            _log(f"arm {name!r} failed: {'; '.join(s['errors'])}")
            rc = 1
    for name, f in (results.get("floor") or {}).items():
        if f["errors"]:
            _log(f"the floor of arm {name!r} is missing: {'; '.join(f['errors'])}")
            rc = 1
    if require_identical:
        ident = results["identity"]
        if ident["reference"] is None:
            _log("--require-identical: the reference arm has no successful run to compare with")
            rc = 1
        elif not ident["identical"]:
            bad = [n for n, a in ident["arms"].items() if a["mismatched_steps"]]
            _log(f"--require-identical: argmax differs from the reference in arm(s) {', '.join(bad)}")
            rc = 1
    return rc
