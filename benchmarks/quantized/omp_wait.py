"""torch's OpenMP wait policy against sluice's native pool (issue 14): resident prefill of a 32-token prompt and
the 18 decode steps after it, each arm a fresh process (libgomp reads its policy once, at load), arms alternated.
`passive` is what importing sluice sets (OMP_WAIT_POLICY=PASSIVE); `libgomp default` is the policy of an unset
environment (spin 300,000 rounds after each parallel op, then sleep: OMP_WAIT_POLICY=ACTIVE with
GOMP_SPINCOUNT=300000). Prints per round and arm: prefill ms (median of 3 replays), decode ms/token mean and
median (of the last replay), and how late the pool's worker started a job's tasks.

    PYTHONPATH=. .venv/bin/python benchmarks/quantized/omp_wait.py [GGUF] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ARMS = {"passive": {"OMP_WAIT_POLICY": "PASSIVE"},
        "libgomp default": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}}


def child(model: str) -> None:
    import sluice

    with sluice.load(model, memory="all", threads=2) as m:
        prompt = [100 + (i * 7) % 30000 for i in range(32)]
        tokens = list(range(200, 219))
        prefill = []
        for _ in range(3):
            m.replay(prompt, tokens)
            prefill.append(m.step_times.prefill_s)
        dec = m.step_times.decode_s
        print(json.dumps({"prefill_ms": 1000 * statistics.median(prefill), "decode_mean": 1000 * statistics.mean(dec),
                          "decode_median": 1000 * statistics.median(dec)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="benchmarks/models/qwen3_moe-peers/model-Q4_K_M.gguf")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.model)
    res: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for r in range(a.rounds):
        for arm in (list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]):
            env = {**os.environ, **ARMS[arm]}
            out = subprocess.run([sys.executable, __file__, a.model, "--child"], env=env, check=True,
                                 capture_output=True, text=True).stdout
            res[arm].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {r} {arm}: " + ", ".join(f"{k} {v:.1f}" for k, v in res[arm][-1].items()), flush=True)
    for arm, rows in res.items():
        print(f"{arm}: " + ", ".join(f"{k} {statistics.median(row[k] for row in rows):.1f}" for k in rows[0]))


if __name__ == "__main__":
    main()
