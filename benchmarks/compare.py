"""The comparisons made before `sluice bench` existed: each arm a fresh child process per round, the arms in
rotated order (benchmarks/common.py alternate), medians over rounds, the greedy tokens checked identical across arms;
each writes benchmarks/results/<name>.{md,json} (contention: a folder, with a plot).

    .venv/bin/python benchmarks/compare.py resident-decode --size 1GiB --rounds 3 --tokens 32
    .venv/bin/python benchmarks/compare.py resident-prefill --rounds 3 --prompts 512 2048   # [--model FOLDER]
    .venv/bin/python benchmarks/compare.py streaming-modes --size 4GiB --ceiling 1GiB --memory 640MiB --tokens 24
    .venv/bin/python benchmarks/compare.py contention --rounds 3 --tokens 48

(They were benchmarks/resident_decode.py, resident_prefill.py, streaming_modes.py and contention.py, with the same
arguments; the results' "command" fields name those.)

resident-decode / resident-prefill (issues 2 and 15: >= 1.5x at 512 and 2,048 tokens): sluice vs transformers with
everything resident, on the same synthetic qwen3_moe checkpoint (bf16, greedy): transformers in bf16 with its KV
cache, sluice.load with everything resident; both decode the same greedy continuation of the same seeded prompt.
decode: a 16-token prompt, the median per-token decode time (median over rounds of each run's median step).
prefill: the prompt's prefill time, then 2 decoded tokens.

streaming-modes (issue 3): a ~4 GiB synthetic qwen3_moe under a 1 GiB memory ceiling (page cache included), for each
reader: decode ms/token, hit rate, bytes read per token, major faults per token. Each run is a `sluice run --json`
child inside a memory cgroup, after evicting the model files and checking with mincore that <= 1% of them is
resident. All modes must produce the same greedy tokens (exactness), so they do identical work.

contention (issue 12, item 10): decode beside one busy process gets its fair share, not a cliff. On a 2-core machine,
each arm is one `sluice run --json` child; the condition is either a quiet machine or one competing process started
just before the child and killed after it: `busy` is a single-threaded spin loop (any CPU-bound job a user runs beside
the model), `sluice` a second `sluice run` of the same model in a loop (two models served from one box). Arms:
`sluice` is the default: the thread count follows the CPUs other processes leave free (host/cpus.py ThreadGovernor),
OpenMP waits as libgomp does by default (spins ~300,000 iterations, then sleeps); `before` is what sluice did before
(a fixed thread per CPU); `passive` keeps the fixed count and makes waiting threads sleep at once
(OMP_WAIT_POLICY=PASSIVE), the other cure considered. Medians of per-run median step times. Target: decode beside one
busy process <= 2.2x the quiet decode (2 cores: a fair share is 1 of 2), quiet speed unchanged.

Nothing of sluice is imported at this module's top (benchmarks/common.py imports it only where used): the
transformers child must run without it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import alternate, child_json, commit  # noqa: E402
from sluice.host.cpus import cpu_line, describe_cpu  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
RESIDENT_ARMS = ["sluice", "transformers"]


# -- resident-decode, resident-prefill ---------------------------------------------------------------------------------
def resident_child(arm: str, folder: str, tokens: int, prompt_len: int) -> dict:
    """One arm's run in this (fresh) process: greedy tokens, decode step ms, prefill ms. Nothing of sluice is
    imported for the transformers arm."""
    if arm == "sluice":
        import sluice  # noqa: F401  before torch, as `sluice run` has it: it sets torch's OpenMP wait policy
    import torch

    torch.manual_seed(0)
    prompt = torch.randint(3, 1000, (prompt_len,)).tolist()
    if arm == "sluice":
        import sluice

        with sluice.load(folder) as m:
            out = list(m.generate_tokens(prompt, max_tokens=tokens, stop_at_eos=False))
            st = m.stats()
        return {"tokens": out, "step_ms": [1000 * s for s in m.step_times.decode_s], "prefill_ms": st["prefill_ms"]}
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    out, steps = [], []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        t0 = time.perf_counter()
        logits = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits[0, -1]
        prefill_ms = 1000 * (time.perf_counter() - t0)
        tok = int(logits.float().argmax())
        out.append(tok)
        for _ in range(tokens - 1):
            t0 = time.perf_counter()
            logits = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True).logits[0, -1]
            tok = int(logits.float().argmax())
            steps.append(1000 * (time.perf_counter() - t0))
            out.append(tok)
    return {"tokens": out, "step_ms": steps, "prefill_ms": prefill_ms}


def run_arms(folder: str, tokens: int, prompt_len: int, rounds: int, label) -> dict[str, list[dict]]:
    """Both arms, a fresh child each, alternated per round; label(round, arm, result) is printed to stderr."""
    def arm(name: str):
        def run() -> dict:
            cmd = [sys.executable, __file__, "resident-child", name, folder, "--tokens", str(tokens),
                   "--prompt-len", str(prompt_len)]
            return child_json(cmd)
        return run

    return alternate({name: arm(name) for name in RESIDENT_ARMS}, rounds,
                     report=lambda r, name, res: print(label(r, name, res), file=sys.stderr))


def resident_decode(a) -> None:
    from sluice.options import parse_size
    from sluice.tools.synth import config_for_size, make_model

    folder = Path(a.model) if a.model else ROOT / "benchmarks" / "models" / f"qwen3_moe-{a.size}"
    if not (folder / "config.json").exists():
        make_model(folder, config_for_size("qwen3_moe", parse_size(a.size)), progress=True)
    runs = run_arms(str(folder), a.tokens, a.prompt_len, a.rounds,
                    lambda r, arm, res: f"round {r} {arm}: median {statistics.median(res['step_ms']):.1f} ms/token")
    identical = all(x["tokens"] == runs["sluice"][0]["tokens"] for arm in RESIDENT_ARMS for x in runs[arm])
    med = {arm: statistics.median(statistics.median(x["step_ms"]) for x in runs[arm]) for arm in RESIDENT_ARMS}
    size_gb = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9
    result = {
        "model": folder.name, "model_gb": round(size_gb, 3), "rounds": a.rounds, "tokens": a.tokens,
        "median_ms_per_token": {k: round(v, 2) for k, v in med.items()},
        "per_round_ms": {arm: [round(statistics.median(x["step_ms"]), 2) for x in runs[arm]] for arm in RESIDENT_ARMS},
        "speedup": round(med["transformers"] / med["sluice"], 2),
        "identical_greedy_tokens": identical,
        "command": "python benchmarks/compare.py " + " ".join(sys.argv[1:]),
        "cpu": describe_cpu(), "commit": commit(),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "resident_decode.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [
        f"# Resident decode: sluice vs transformers ({folder.name}, {size_gb:.2f} GB, bf16, greedy)",
        "",
        "| arm | median ms/token | per round | tok/s |",
        "|---|---|---|---|",
    ]
    for arm in RESIDENT_ARMS:
        md.append(f"| {arm} | {med[arm]:.1f} | {result['per_round_ms'][arm]} | {1000 / med[arm]:.1f} |")
    md += ["", f"sluice is {result['speedup']}x faster; identical greedy tokens: {identical}.", "",
           f"Command: `{result['command']}` at {result['commit']}; CPU {cpu_line(result['cpu'])}", ""]
    (OUT / "resident_decode.md").write_text("\n".join(md))
    print("\n".join(md))


def resident_prefill(a) -> None:
    model = a.model or str(ROOT / "benchmarks" / "models" / "qwen3_moe-1GiB")
    rows, result = [], {"model": Path(model).name, "rounds": a.rounds, "prompts": {}}
    for n in a.prompts:
        runs = run_arms(model, 2, n, a.rounds,
                        lambda r, arm, res, n=n: f"{n} tokens, round {r} {arm}: {res['prefill_ms']:.0f} ms")
        med = {arm: statistics.median(x["prefill_ms"] for x in runs[arm]) for arm in RESIDENT_ARMS}
        same = all(x["tokens"] == runs["sluice"][0]["tokens"] for arm in RESIDENT_ARMS for x in runs[arm])
        result["prompts"][n] = {"median_prefill_ms": {k: round(v, 1) for k, v in med.items()},
                                "tok_s": {k: round(1000 * n / v, 1) for k, v in med.items()},
                                "speedup": round(med["transformers"] / med["sluice"], 2), "same_tokens": same}
        rows.append(f"| {n} | {1000 * n / med['sluice']:.0f} | {1000 * n / med['transformers']:.0f} | "
                    f"{med['transformers'] / med['sluice']:.2f}x | {same} |")
    result["command"] = "python benchmarks/compare.py " + " ".join(sys.argv[1:])
    result["cpu"], result["commit"] = describe_cpu(), commit()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "resident_prefill.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# Resident prefill: sluice vs transformers ({result['model']}, bf16, medians of {a.rounds} rounds)", "",
          "| prompt tokens | sluice tok/s | transformers tok/s | sluice vs transformers | same next tokens |",
          "|---|---|---|---|---|", *rows, "",
          f"Command: `{result['command']}` at {result['commit']}; CPU {cpu_line(result['cpu'])}", ""]
    (OUT / "resident_prefill.md").write_text("\n".join(md))
    print("\n".join(md))


# -- streaming-modes ---------------------------------------------------------------------------------------------------
MODES = {"mmap": ["--io", "mmap"], "willneed": ["--io", "willneed"], "direct": ["--io", "direct", "--no-odirect"],
         "direct+odirect": ["--io", "direct", "--odirect"]}


def run_once(model: Path, flags: list[str], a) -> dict:
    """One cold `sluice run --json` child of one reader inside the memory cgroup, after evicting the model files."""
    from sluice.io.residency import evict, resident_fraction, run_in_memory_cgroup
    from sluice.options import parse_size

    files = sorted(model.glob("*.safetensors"))
    for f in files:
        evict(f)
    total = sum(f.stat().st_size for f in files)
    resident = sum(resident_fraction(f) * f.stat().st_size for f in files) / total
    if resident > 0.01:
        raise SystemExit(f"cold start not verified: {100 * resident:.2f}% of the model is still resident")
    argv = [sys.executable, "-m", "sluice", "run", str(model), "--prompt", a.prompt, "--max-tokens", str(a.tokens),
            "--memory", a.memory, "--max-context", "512", "--json", *flags]
    with tempfile.TemporaryFile("w+") as out:
        r = run_in_memory_cgroup(argv, parse_size(a.ceiling), timeout=3600, stdout=out, stderr=subprocess.DEVNULL)
        out.seek(0)
        text = out.read()
    if r.oom_killed or r.returncode != 0:
        return {"oom": r.oom_killed, "returncode": r.returncode, "resident_before": resident}
    res = json.loads(text.strip().splitlines()[-1])
    st, n = res["stats"], max(1, res["stats"]["tokens"])
    return {
        "tokens": res["tokens"],
        "decode_ms_per_token": st["decode_ms_median"],
        "hit_rate": st["hit_rate"],
        "expert_bytes_per_token": st["bytes_read"] / n,
        "disk_bytes_per_token": st["disk_read_bytes"] / n,
        "major_faults_per_token": st["major_faults"] / n,
        "peak_rss_bytes": st["peak_rss_bytes"],
        "cgroup_peak_bytes": r.peak_bytes,
        "resident_before": resident,
    }


def streaming_modes(a) -> None:
    from sluice.options import format_bytes, parse_size
    from sluice.tools.synth import config_for_size, make_model

    model = ROOT / "benchmarks" / "models" / f"qwen3_moe-{a.size}"
    if not (model / "config.json").exists():
        make_model(model, config_for_size("qwen3_moe", parse_size(a.size)), progress=True)
    modes = a.modes.split(",")
    runs = alternate({m: (lambda m=m: run_once(model, MODES[m], a)) for m in modes}, a.rounds,
                     report=lambda r, m, res: print(f"round {r} {m}: {res.get('decode_ms_per_token', 'OOM')} ms/token",
                                                    file=sys.stderr, flush=True))
    ok = {m: [x for x in v if "tokens" in x] for m, v in runs.items()}
    ref = next((v[0]["tokens"] for v in ok.values() if v), None)
    identical = all(x["tokens"] == ref for v in ok.values() for x in v)
    keys = ["decode_ms_per_token", "hit_rate", "expert_bytes_per_token", "disk_bytes_per_token",
            "major_faults_per_token", "peak_rss_bytes"]
    med = {m: {k: statistics.median(x[k] for x in v) for k in keys} for m, v in ok.items() if v}
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    cmd = "python benchmarks/compare.py " + " ".join(sys.argv[1:])
    result = {"model": model.name, "model_bytes": size, "ceiling": a.ceiling, "memory": a.memory,
              "rounds": a.rounds, "tokens": a.tokens, "identical_greedy_tokens": identical, "median": med,
              "runs": runs, "command": cmd, "cpu": describe_cpu(), "commit": commit()}
    out = OUT
    out.mkdir(parents=True, exist_ok=True)
    (out / "streaming_modes.json").write_text(json.dumps(result, indent=2) + "\n")
    base = med.get("mmap", {}).get("decode_ms_per_token")
    lines = [f"# Streaming readers: {model.name} ({format_bytes(size)}), --memory {a.memory}, cgroup ceiling "
             f"{a.ceiling}, cold (verified <= 1% resident), {a.tokens} greedy tokens, median of {a.rounds} rounds",
             "", "| io | decode ms/token | vs mmap | hit rate | expert MB read/token | disk MB read/token | "
             "major faults/token | peak RSS |", "|---|---|---|---|---|---|---|---|"]
    for m in modes:
        if m not in med:
            lines.append(f"| {m} | OOM-killed or failed | | | | | | |")
            continue
        d = med[m]
        speed = f"{base / d['decode_ms_per_token']:.2f}x" if base else ""
        lines.append(f"| {m} | {d['decode_ms_per_token']:.0f} | {speed} | {100 * d['hit_rate']:.1f}% | "
                     f"{d['expert_bytes_per_token'] / 1e6:.0f} | {d['disk_bytes_per_token'] / 1e6:.0f} | "
                     f"{d['major_faults_per_token']:.0f} | {format_bytes(d['peak_rss_bytes'])} |")
    lines += ["", f"Identical greedy tokens across all modes and rounds: {identical}.", "",
              f"Command: `{cmd}` at {result['commit']}; CPU {cpu_line(result['cpu'])}", ""]
    (out / "streaming_modes.md").write_text("\n".join(lines))
    print("\n".join(lines))


# -- contention --------------------------------------------------------------------------------------------------------
FIXED = ["--threads", str(os.cpu_count())]
# arm -> (environment, extra `sluice run` flags); --spin N adds "spinN" (that spin count, fixed threads)
POLICIES: dict[str, tuple[dict, list[str]]] = {"sluice": ({}, []), "before": ({}, FIXED),
                                                "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, FIXED)}
SPIN_LOOP = "while True: pass"
CONTENTION_OUT = OUT / "contention"


def _env(policy: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return {**env, **POLICIES[policy][0]}


def _run_cmd(model: Path, flags: list[str], tokens: int) -> list[str]:
    return [sys.executable, "-m", "sluice", "run", str(model), "--prompt", "The module", "--max-tokens",
            str(tokens), "--json", *flags]


def _competitor(kind: str, model: Path, flags: list[str], policy: str) -> subprocess.Popen | None:
    if kind == "quiet":
        return None
    if kind == "busy":
        cmd = [sys.executable, "-c", SPIN_LOOP]
    else:  # a second sluice process decoding the same model, over and over
        loop = f"while :; do {' '.join(_run_cmd(model, flags, 64))} >/dev/null 2>&1; done"
        cmd = ["bash", "-c", loop]
    return subprocess.Popen(cmd, env=_env(policy), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _one(model: Path, flags: list[str], tokens: int, policy: str, condition: str) -> dict:
    flags = flags + POLICIES[policy][1]
    comp = _competitor(condition, model, flags, policy)  # the same arm: a second sluice runs as this one does
    try:
        r = subprocess.run(_run_cmd(model, flags, tokens), env=_env(policy), capture_output=True, text=True,
                           timeout=1800)
    finally:
        if comp is not None:
            os.killpg(comp.pid, 9)
            comp.wait()
    if r.returncode != 0:
        raise SystemExit(f"{policy}/{condition} failed:\n{r.stderr}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    st = out["stats"]
    return {"tokens": out["tokens"], "ms": st["decode_ms_median"], "threads": st.get("threads"),
            "thread_changes": st.get("thread_changes")}


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios, conds = list(result["median_ms"]), result["conditions"]
    fig, axes = plt.subplots(1, len(scenarios), figsize=(5 * len(scenarios), 3.6), squeeze=False)
    for ax, sc in zip(axes[0], scenarios):
        width = 0.8 / len(POLICIES)
        for i, pol in enumerate(POLICIES):
            vals = [result["median_ms"][sc][pol][c] for c in conds]
            ax.bar([j + i * width for j in range(len(conds))], vals, width, label=pol)
        ax.set_xticks([j + width * (len(POLICIES) - 1) / 2 for j in range(len(conds))], conds)
        ax.set_ylabel("decode ms/token (median)")
        ax.set_title(sc)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def contention(a) -> None:
    for n in a.spin:
        POLICIES[f"spin{n}"] = ({"GOMP_SPINCOUNT": str(n)}, FIXED)
    chosen = a.arms.split(",") + [f"spin{n}" for n in a.spin]
    if unknown := set(chosen) - set(POLICIES):
        raise SystemExit(f"unknown arm(s) {', '.join(sorted(unknown))}; known: {', '.join(POLICIES)}")
    for name in [p for p in POLICIES if p not in chosen]:
        del POLICIES[name]
    from sluice.options import parse_size
    from sluice.plan import open_index
    from sluice.tools.inflate import demo_model_dir, inflate, scale_for_size

    model = Path(a.model) if a.model else ROOT / "benchmarks" / "models" / f"demo-{a.size}"
    if not (model / "config.json").exists():
        n = scale_for_size(open_index(demo_model_dir()), parse_size(a.size))
        inflate("demo", model, n, progress=True)
    scenarios = {"resident": ["--memory", "all"],
                 "streamed": ["--memory", a.stream_memory, "--io", "direct"]}
    scenarios = {k: v for k, v in scenarios.items() if k in a.scenarios.split(",")}
    conds = a.conditions.split(",")
    arms = [(s, p, c) for s in scenarios for p in POLICIES for c in conds]

    def one(sc: str, pol: str, cond: str):
        return lambda: _one(model, scenarios[sc], a.tokens, pol, cond)

    def report(r: int, arm: tuple, res: dict) -> None:
        print(f"round {r} {arm[0]:9s} {arm[1]:8s} {arm[2]:7s} {res['ms']:8.1f} ms/token", file=sys.stderr)

    runs = alternate({arm: one(*arm) for arm in arms}, a.rounds, report)  # rotated: no arm always runs first
    ref = runs[arms[0]][0]["tokens"]
    identical = all(x["tokens"] == ref for v in runs.values() for x in v)
    med = {sc: {p: {c: round(statistics.median(x["ms"] for x in runs[(sc, p, c)]), 1) for c in conds}
                for p in POLICIES} for sc in scenarios}
    result = {"model": model.name, "rounds": a.rounds, "tokens": a.tokens, "cpus": os.cpu_count(),
              "conditions": conds, "median_ms": med, "identical_tokens": identical,
              "per_round_ms": {"/".join(k): [x["ms"] for x in v] for k, v in runs.items()},
              "command": "python benchmarks/compare.py " + " ".join(sys.argv[1:]),
              "cpu": describe_cpu(), "commit": commit()}
    CONTENTION_OUT.mkdir(parents=True, exist_ok=True)
    (CONTENTION_OUT / "contention.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, CONTENTION_OUT / "contention.png")
    md = [f"# Decode under CPU contention ({model.name}, {os.cpu_count()} CPUs, median of {a.rounds} rounds)", "",
          "| scenario | arm | " + " | ".join(f"{c} ms/token" for c in conds) + " | "
          + " | ".join(f"{c} / quiet" for c in conds if c != "quiet") + " |",
          "|---|---|" + "---|" * (2 * len(conds) - 1)]
    for sc in scenarios:
        for p in POLICIES:
            m = med[sc][p]
            ratios = [f"{m[c] / m['quiet']:.2f}x" for c in conds if c != "quiet"]
            md.append(f"| {sc} | {p} | " + " | ".join(f"{m[c]:.1f}" for c in conds) + " | " + " | ".join(ratios)
                      + " |")
    md += ["", f"Identical greedy tokens in every run: {identical}.", "",
           f"Command: `{result['command']}` at {result['commit']}; CPU {cpu_line(result['cpu'])}", ""]
    (CONTENTION_OUT / "contention.md").write_text("\n".join(md))
    print("\n".join(md))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True,
                            metavar="{resident-decode,resident-prefill,streaming-modes,contention}")
    d = sub.add_parser("resident-decode", help="median ms/token of a greedy decode, sluice vs transformers")
    d.add_argument("--size", default="1GiB")
    d.add_argument("--model", default=None, help="existing model folder (default: build one in benchmarks/models)")
    d.add_argument("--rounds", type=int, default=3)
    d.add_argument("--tokens", type=int, default=32)
    d.add_argument("--prompt-len", type=int, default=16)
    p = sub.add_parser("resident-prefill", help="prefill tok/s of seeded prompts, sluice vs transformers")
    p.add_argument("--model", default=None, help="model folder (default: benchmarks/models/qwen3_moe-1GiB)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, nargs="+", default=[512, 2048])
    c = sub.add_parser("resident-child", help=argparse.SUPPRESS)
    c.add_argument("arm", choices=RESIDENT_ARMS)
    c.add_argument("folder")
    c.add_argument("--tokens", type=int, required=True)
    c.add_argument("--prompt-len", type=int, required=True)
    s = sub.add_parser("streaming-modes", help="the four readers under a memory ceiling, cold")
    s.add_argument("--size", default="4GiB")
    s.add_argument("--ceiling", default="1GiB")
    s.add_argument("--memory", default="640MiB")
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--tokens", type=int, default=24)
    s.add_argument("--prompt", default="The history of the river")
    s.add_argument("--modes", default=",".join(MODES))
    k = sub.add_parser("contention", help="decode beside a busy process")
    k.add_argument("--model", default=None, help="model folder (default: the demo inflated to --size)")
    k.add_argument("--size", default="1GiB")
    k.add_argument("--stream-memory", default="384MiB", help="--memory of the streamed scenario")
    k.add_argument("--rounds", type=int, default=3)
    k.add_argument("--tokens", type=int, default=48)
    k.add_argument("--conditions", default="quiet,busy,sluice")
    k.add_argument("--scenarios", default="resident,streamed")
    k.add_argument("--spin", type=int, action="append", default=[], metavar="N",
                   help="also an arm with GOMP_SPINCOUNT=N (a spin this long before sleeping) and fixed threads")
    k.add_argument("--arms", default=",".join(POLICIES), help=f"comma-separated, of {', '.join(POLICIES)}")
    a = ap.parse_args()
    if a.what == "resident-child":
        print(json.dumps(resident_child(a.arm, a.folder, a.tokens, a.prompt_len)))
        return
    {"resident-decode": resident_decode, "resident-prefill": resident_prefill, "streaming-modes": streaming_modes,
     "contention": contention}[a.what](a)


if __name__ == "__main__":
    main()
