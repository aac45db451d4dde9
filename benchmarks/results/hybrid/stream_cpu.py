"""CPU time of a streamed decode step, two checkouts of sluice paired: each round runs one fresh process per
checkout (order rotated), each loads the model streamed (--io direct, O_DIRECT, a budget below the experts), decodes
`warmup` untimed greedy tokens, then `tokens` timed ones, and reports per token: wall ms, process CPU ms (all
threads: the caller, the native pool's workers, the reader threads), the calling thread's CPU ms, and the expert
bytes read (O_DIRECT: all of them from the disk).

    python benchmarks/results/hybrid/stream_cpu.py MODEL --arm base=DIR --arm new=DIR [--memory 384MiB]
        [--rounds 4] [--tokens 24] [--warmup 8] [--threads 2]

Each arm's process imports sluice from its DIR (PYTHONPATH), which must have its native library built in place.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import sluice
model, memory, tokens, warmup, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
def cpu(who):
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime
m = sluice.load(model, memory=memory, io="direct", odirect=True, threads=threads, max_context=64 + warmup + tokens)
ids = [5, 6, 7, 8]
list(m.generate_tokens(ids, max_tokens=warmup, temperature=0.0))
s0 = m.stats()
c0, t0, w0 = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_THREAD), time.perf_counter()
out = list(m.generate_tokens(ids, max_tokens=tokens, temperature=0.0))
w1, c1, t1 = time.perf_counter(), cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_THREAD)
s1 = m.stats()
n = len(out)
print(json.dumps({"sluice": sluice.__file__, "tokens": n, "ms": 1000 * (w1 - w0) / n, "cpu_ms": 1000 * (c1 - c0) / n,
                  "caller_cpu_ms": 1000 * (t1 - t0) / n, "mib_read": (s1["bytes_read"] - s0["bytes_read"]) / n / 2**20,
                  "hits": s1["hits"] - s0["hits"], "misses": s1["misses"] - s0["misses"], "ids": out}))
"""


def run_arm(directory: str, a: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(directory))
    cmd = [sys.executable, "-c", CHILD, os.path.abspath(a.model), a.memory, str(a.tokens), str(a.warmup),
           str(a.threads)]
    got = subprocess.run(cmd, env=env, cwd=directory, capture_output=True, text=True, timeout=600)
    if got.returncode != 0:
        raise SystemExit(f"{directory}: exit {got.returncode}\n{got.stderr[-3000:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--arm", action="append", required=True, help="NAME=DIR (a sluice checkout, built in place)")
    p.add_argument("--memory", default="384MiB")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    arms = [tuple(s.split("=", 1)) for s in a.arm]
    results: dict[str, list[dict]] = {name: [] for name, _ in arms}
    for r in range(a.rounds):
        order = arms[r % len(arms):] + arms[: r % len(arms)]
        for name, directory in order:
            got = run_arm(directory, a)
            results[name].append(got)
            print(f"round {r} {name:6s} {got['ms']:7.1f} ms/token  CPU {got['cpu_ms']:7.1f} ms/token  caller CPU "
                  f"{got['caller_cpu_ms']:6.1f}  {got['mib_read']:6.1f} MiB read/token  hits {got['hits']} misses "
                  f"{got['misses']}  ({os.path.dirname(got['sluice'])})", flush=True)
    ref = results[arms[0][0]]
    for name, _ in arms:
        rs = results[name]
        same = all(x["ids"] == y["ids"] for x, y in zip(rs, ref))
        print(f"{name:6s} median {statistics.median(x['ms'] for x in rs):7.1f} ms/token, CPU "
              f"{statistics.median(x['cpu_ms'] for x in rs):7.1f} ms/token, caller CPU "
              f"{statistics.median(x['caller_cpu_ms'] for x in rs):6.1f} ms/token, "
              f"{statistics.median(x['mib_read'] for x in rs):6.1f} MiB read/token; tokens as {arms[0][0]}'s: {same}")
    for name, _ in arms[1:]:
        wins = sum(x["ms"] < y["ms"] for x, y in zip(results[name], ref))
        cpu_wins = sum(x["cpu_ms"] < y["cpu_ms"] for x, y in zip(results[name], ref))
        print(f"{name} vs {arms[0][0]}: faster in {wins}/{a.rounds} rounds, less CPU in {cpu_wins}/{a.rounds}")


if __name__ == "__main__":
    main()
