"""torch's OpenMP wait policy against sluice's native pool (issue 14): resident prefill of a prompt (default 32
tokens) and the 18 decode steps after it, each arm a fresh process (libgomp reads its policy once, at load), arms
alternated. `sluice default` is what importing sluice sets (OMP_WAIT_POLICY=PASSIVE with GOMP_SPINCOUNT=1000: a
worker spins ~10 us after each parallel op, then sleeps); `spin 30 us` (GOMP_SPINCOUNT=3000); `passive` sleeps at
once (the default before); `libgomp default` is the policy of an unset environment (spin 300,000 rounds, ~3 ms).
Prints per round and arm: prefill ms (median of 3 replays), decode ms/token mean and median (of the last replay).

    PYTHONPATH=. .venv/bin/python benchmarks/quantized/omp_wait.py [MODEL] [--prompt 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ARMS = {"sluice default": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"},
        "spin 30 us": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000"},
        "passive": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"},
        "libgomp default": {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}}


def child(model: str, n: int) -> None:
    import sluice

    with sluice.load(model, memory="all", threads=2) as m:
        prompt = [100 + (i * 7919) % (m.spec.vocab_size - 100) for i in range(n)]
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
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.model, a.prompt)
    res: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for r in range(a.rounds):
        for arm in (list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]):
            env = {**os.environ, **ARMS[arm]}
            cmd = [sys.executable, __file__, a.model, "--prompt", str(a.prompt), "--child"]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            res[arm].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {r} {arm}: " + ", ".join(f"{k} {v:.1f}" for k, v in res[arm][-1].items()), flush=True)
    for arm, rows in res.items():
        print(f"{arm}: " + ", ".join(f"{k} {statistics.median(row[k] for row in rows):.1f}" for k in rows[0]))


if __name__ == "__main__":
    main()
