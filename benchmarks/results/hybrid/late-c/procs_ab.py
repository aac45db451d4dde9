"""Alternate-process A/B of two checkouts on one model's streamed decode (each with its own native build): per round,
each checkout in a fresh process (order rotated per round) loads MODEL as benchmarks/common.py decode_stream does
for MODE (--memory 640MiB, O_DIRECT, no cgroup; auto: --prefetch auto), skips 40 tokens of the greedy stream after
[5, 6], then times TOKENS tokens after one untimed. Prints each run, each arm's median and min, and the paired median
(before - after) with the rounds `after` won. For a change that in-process switching cannot reach (C code).

    .venv/bin/python benchmarks/results/hybrid/late-c/procs_ab.py ROUNDS MODEL BEFORE_ROOT AFTER_ROOT [MODE] [TOKENS]
"""
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import sys, time
sys.path.insert(0, ".")
import sluice  # noqa: F401
from benchmarks.common import decode_stream, timed_tokens
m, it = decode_stream(sys.argv[1], sys.argv[2])
ms = timed_tokens(it, int(sys.argv[3]))
s = m.store.stats()
print(f"RESULT {ms:.3f} {s['hits']} {s['misses']}")
it.close()
m.close()
"""


def run(root: str, model: str, mode: str, tokens: int) -> tuple[float, str]:
    p = subprocess.run([sys.executable, "-c", CHILD, str(Path(model).resolve()), mode, str(tokens)], cwd=root,
                       capture_output=True, text=True, check=False)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode or line is None:
        raise SystemExit(f"{root}: rc {p.returncode}\n{p.stderr[-2000:]}")
    ms, hits, misses = line.split()[1:]
    return float(ms), f"hits {hits} misses {misses}"


def main() -> None:
    rounds, model, before, after = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    mode = sys.argv[5] if len(sys.argv) > 5 else "auto"
    tokens = int(sys.argv[6]) if len(sys.argv) > 6 else 64
    arms = {"before": before, "after": after}
    res: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(rounds):
        order = list(arms) if r % 2 == 0 else list(arms)[::-1]
        for name in order:
            ms, what = run(arms[name], model, mode, tokens)
            res[name].append(ms)
            print(f"round {r + 1} {name} ({arms[name]}): {ms:.2f} ms/token ({what})", flush=True)
    for name in arms:
        print(f"{mode} {name}: median {statistics.median(res[name]):.2f} ms/token, min {min(res[name]):.2f}")
    d = [b - a for b, a in zip(res["before"], res["after"])]
    print(f"paired (before - after): median {statistics.median(d):+.2f} ms, {sum(x > 0 for x in d)}/{len(d)} rounds "
          "faster after")


main()
