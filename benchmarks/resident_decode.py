"""Resident decode speed of sluice vs transformers on the same synthetic qwen3_moe checkpoint (issue 2 target).

    .venv/bin/python benchmarks/resident_decode.py --size 1GiB --rounds 3 --tokens 32

Each arm runs in a fresh child process per round, arms alternate order each round, both decode the same greedy
continuation of the same prompt (token identity is checked), and we report the median per-token decode time.
Results: benchmarks/results/resident_decode.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"


def child(arm: str, folder: str, tokens: int, prompt_len: int) -> dict:
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--model", default=None, help="existing model folder (default: build one in benchmarks/models)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--child", nargs=2, metavar=("ARM", "FOLDER"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], a.tokens, a.prompt_len)))
        return
    from sluice.options import parse_size
    from sluice.tools.synth import config_for_size, make_model

    folder = Path(a.model) if a.model else ROOT / "benchmarks" / "models" / f"qwen3_moe-{a.size}"
    if not (folder / "config.json").exists():
        make_model(folder, config_for_size("qwen3_moe", parse_size(a.size)), progress=True)
    arms = ["sluice", "transformers"]
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for r in range(a.rounds):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            cmd = [sys.executable, __file__, "--child", arm, str(folder), "--tokens", str(a.tokens),
                   "--prompt-len", str(a.prompt_len)]
            res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            runs[arm].append(res)
            print(f"round {r} {arm}: median {statistics.median(res['step_ms']):.1f} ms/token", file=sys.stderr)
    identical = all(x["tokens"] == runs["sluice"][0]["tokens"] for arm in arms for x in runs[arm])
    med = {arm: statistics.median(statistics.median(x["step_ms"]) for x in runs[arm]) for arm in arms}
    size_gb = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9
    result = {
        "model": folder.name, "model_gb": round(size_gb, 3), "rounds": a.rounds, "tokens": a.tokens,
        "median_ms_per_token": {k: round(v, 2) for k, v in med.items()},
        "per_round_ms": {arm: [round(statistics.median(x["step_ms"]), 2) for x in runs[arm]] for arm in arms},
        "speedup": round(med["transformers"] / med["sluice"], 2),
        "identical_greedy_tokens": identical,
        "command": "python benchmarks/resident_decode.py " + " ".join(sys.argv[1:]),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "resident_decode.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [
        f"# Resident decode: sluice vs transformers ({folder.name}, {size_gb:.2f} GB, bf16, greedy)",
        "",
        "| arm | median ms/token | per round | tok/s |",
        "|---|---|---|---|",
    ]
    for arm in arms:
        md.append(f"| {arm} | {med[arm]:.1f} | {result['per_round_ms'][arm]} | {1000 / med[arm]:.1f} |")
    md += ["", f"sluice is {result['speedup']}x faster; identical greedy tokens: {identical}.", "",
           f"Command: `{result['command']}`", ""]
    (OUT / "resident_decode.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
