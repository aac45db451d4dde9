"""Decode under CPU contention: sluice beside one busy process gets its fair share, not a cliff (issue 12, item 10).

    .venv/bin/python benchmarks/contention.py --rounds 3 --tokens 48

On a 2-core machine, each arm is one `sluice run --json` child; the condition is either a quiet machine or one
competing process started just before the child and killed after it: `busy` is a single-threaded spin loop (any
CPU-bound job a user runs beside the model), `sluice` a second `sluice run` of the same model in a loop (two
models served from one box). Arms: `sluice` is the default: the thread count follows the CPUs other processes
leave free (host/cpus.py ThreadGovernor), OpenMP waits as libgomp does by default (spins ~300,000 iterations, then
sleeps); `before` is what sluice did before (a fixed thread per CPU); `passive` keeps the fixed count and makes
waiting threads sleep at once (OMP_WAIT_POLICY=PASSIVE), the other cure considered. Rounds rotate the arm order; medians
of per-run median step times.
Target: decode beside one busy process <= 2.2x the quiet decode (2 cores: a fair share is 1 of 2), quiet speed
unchanged. Results: benchmarks/results/contention/{contention.md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from sluice.plan import open_index

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "contention"
FIXED = ["--threads", str(os.cpu_count())]
# arm -> (environment, extra `sluice run` flags); --spin N adds "spinN" (that spin count, fixed threads)
POLICIES: dict[str, tuple[dict, list[str]]] = {"sluice": ({}, []), "before": ({}, FIXED),
                                                "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, FIXED)}
SPIN_LOOP = "while True: pass"


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the demo inflated to --size)")
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--stream-memory", default="384MiB", help="--memory of the streamed scenario")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--conditions", default="quiet,busy,sluice")
    ap.add_argument("--scenarios", default="resident,streamed")
    ap.add_argument("--spin", type=int, action="append", default=[], metavar="N",
                    help="also an arm with GOMP_SPINCOUNT=N (a spin this long before sleeping) and fixed threads")
    ap.add_argument("--arms", default=",".join(POLICIES), help=f"comma-separated, of {', '.join(POLICIES)}")
    a = ap.parse_args()
    for n in a.spin:
        POLICIES[f"spin{n}"] = ({"GOMP_SPINCOUNT": str(n)}, FIXED)
    chosen = a.arms.split(",") + [f"spin{n}" for n in a.spin]
    if unknown := set(chosen) - set(POLICIES):
        raise SystemExit(f"unknown arm(s) {', '.join(sorted(unknown))}; known: {', '.join(POLICIES)}")
    for name in [p for p in POLICIES if p not in chosen]:
        del POLICIES[name]
    from sluice.tools.inflate import inflate, scale_for_size
    from sluice.tools.inflate import demo_model_dir
    from sluice.options import parse_size

    model = Path(a.model) if a.model else ROOT / "benchmarks" / "models" / f"demo-{a.size}"
    if not (model / "config.json").exists():
        n = scale_for_size(open_index(demo_model_dir()), parse_size(a.size))
        inflate("demo", model, n, progress=True)
    scenarios = {"resident": ["--memory", "all"],
                 "streamed": ["--memory", a.stream_memory, "--io", "direct"]}
    scenarios = {k: v for k, v in scenarios.items() if k in a.scenarios.split(",")}
    conds = a.conditions.split(",")
    arms = [(s, p, c) for s in scenarios for p in POLICIES for c in conds]
    runs: dict[tuple, list[dict]] = {arm: [] for arm in arms}
    for r in range(a.rounds):
        order = arms[r % len(arms):] + arms[: r % len(arms)]  # rotate, so no arm always runs first
        for sc, pol, cond in order:
            res = _one(model, scenarios[sc], a.tokens, pol, cond)
            runs[(sc, pol, cond)].append(res)
            print(f"round {r} {sc:9s} {pol:8s} {cond:7s} {res['ms']:8.1f} ms/token", file=sys.stderr)
    ref = runs[arms[0]][0]["tokens"]
    identical = all(x["tokens"] == ref for v in runs.values() for x in v)
    med = {sc: {p: {c: round(statistics.median(x["ms"] for x in runs[(sc, p, c)]), 1) for c in conds}
                for p in POLICIES} for sc in scenarios}
    result = {"model": model.name, "rounds": a.rounds, "tokens": a.tokens, "cpus": os.cpu_count(),
              "conditions": conds, "median_ms": med, "identical_tokens": identical,
              "per_round_ms": {"/".join(k): [x["ms"] for x in v] for k, v in runs.items()},
              "command": "python benchmarks/contention.py " + " ".join(sys.argv[1:])}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "contention.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, OUT / "contention.png")
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
           f"Command: `{result['command']}`", ""]
    (OUT / "contention.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
