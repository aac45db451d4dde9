"""Resident prefill speed of sluice vs transformers on the same checkpoint (issue 15: >= 1.5x at 512 and 2,048 tokens).

    .venv/bin/python benchmarks/resident_prefill.py --model benchmarks/models/qwen3_moe-1GiB --rounds 3 --prompts 512 2048

Each arm runs in a fresh child process per round (resident_decode.py's child: transformers in bf16 with its KV
cache, sluice.load with everything resident), arms alternate order each round; the prompt is seeded random ids, both
then decode 2 tokens, which must agree. Results: benchmarks/results/resident_prefill.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"
DECODE = ROOT / "benchmarks" / "resident_decode.py"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "benchmarks" / "models" / "qwen3_moe-1GiB"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 2048])
    a = ap.parse_args()
    arms = ["sluice", "transformers"]
    rows, result = [], {"model": Path(a.model).name, "rounds": a.rounds, "prompts": {}}
    for n in a.prompts:
        runs: dict[str, list[dict]] = {arm: [] for arm in arms}
        for r in range(a.rounds):
            for arm in (arms if r % 2 == 0 else arms[::-1]):
                cmd = [sys.executable, str(DECODE), "--child", arm, a.model, "--tokens", "2", "--prompt-len", str(n)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
                runs[arm].append(json.loads(out))
                print(f"{n} tokens, round {r} {arm}: {runs[arm][-1]['prefill_ms']:.0f} ms", file=sys.stderr)
        med = {arm: statistics.median(x["prefill_ms"] for x in runs[arm]) for arm in arms}
        same = all(x["tokens"] == runs["sluice"][0]["tokens"] for arm in arms for x in runs[arm])
        result["prompts"][n] = {"median_prefill_ms": {k: round(v, 1) for k, v in med.items()},
                                "tok_s": {k: round(1000 * n / v, 1) for k, v in med.items()},
                                "speedup": round(med["transformers"] / med["sluice"], 2), "same_tokens": same}
        rows.append(f"| {n} | {1000 * n / med['sluice']:.0f} | {1000 * n / med['transformers']:.0f} | "
                    f"{med['transformers'] / med['sluice']:.2f}x | {same} |")
    result["command"] = "python benchmarks/resident_prefill.py " + " ".join(sys.argv[1:])
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "resident_prefill.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# Resident prefill: sluice vs transformers ({result['model']}, bf16, medians of {a.rounds} rounds)", "",
          "| prompt tokens | sluice tok/s | transformers tok/s | sluice vs transformers | same next tokens |",
          "|---|---|---|---|---|", *rows, "", f"Command: `{result['command']}`", ""]
    (OUT / "resident_prefill.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
