"""sluice vs transformers with everything resident, on the same synthetic qwen3_moe checkpoint (bf16, greedy).

    .venv/bin/python benchmarks/resident.py decode --size 1GiB --rounds 3 --tokens 32      # issue 2's target
    .venv/bin/python benchmarks/resident.py prefill --model benchmarks/models/qwen3_moe-1GiB --rounds 3 \
        --prompts 512 2048                                                                # issue 15: >= 1.5x

Each arm runs in a fresh child process per round (transformers in bf16 with its KV cache, sluice.load with everything
resident), the arms alternated each round (sluice.bench.timing.alternate); both decode the same greedy continuation
of the same seeded prompt, and the tokens must agree.
decode: a 16-token prompt, the median per-token decode time (median over rounds of each run's median step).
Results: benchmarks/results/resident_decode.{md,json}.
prefill: the prompt's prefill time, then 2 decoded tokens; median over rounds.
Results: benchmarks/results/resident_prefill.{md,json}.
(These were benchmarks/resident_decode.py and benchmarks/resident_prefill.py; the results' "command" fields name
those.)
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
ARMS = ["sluice", "transformers"]


def child(arm: str, folder: str, tokens: int, prompt_len: int) -> dict:
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
    from sluice.bench.timing import alternate

    def arm(name: str):
        def run() -> dict:
            cmd = [sys.executable, __file__, "child", name, folder, "--tokens", str(tokens),
                   "--prompt-len", str(prompt_len)]
            return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        return run

    return alternate({name: arm(name) for name in ARMS}, rounds,
                     report=lambda r, name, res: print(label(r, name, res), file=sys.stderr))


def decode(a) -> None:
    from sluice.options import parse_size
    from sluice.tools.synth import config_for_size, make_model

    folder = Path(a.model) if a.model else ROOT / "benchmarks" / "models" / f"qwen3_moe-{a.size}"
    if not (folder / "config.json").exists():
        make_model(folder, config_for_size("qwen3_moe", parse_size(a.size)), progress=True)
    runs = run_arms(str(folder), a.tokens, a.prompt_len, a.rounds,
                    lambda r, arm, res: f"round {r} {arm}: median {statistics.median(res['step_ms']):.1f} ms/token")
    identical = all(x["tokens"] == runs["sluice"][0]["tokens"] for arm in ARMS for x in runs[arm])
    med = {arm: statistics.median(statistics.median(x["step_ms"]) for x in runs[arm]) for arm in ARMS}
    size_gb = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9
    result = {
        "model": folder.name, "model_gb": round(size_gb, 3), "rounds": a.rounds, "tokens": a.tokens,
        "median_ms_per_token": {k: round(v, 2) for k, v in med.items()},
        "per_round_ms": {arm: [round(statistics.median(x["step_ms"]), 2) for x in runs[arm]] for arm in ARMS},
        "speedup": round(med["transformers"] / med["sluice"], 2),
        "identical_greedy_tokens": identical,
        "command": "python benchmarks/resident.py " + " ".join(sys.argv[1:]),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "resident_decode.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [
        f"# Resident decode: sluice vs transformers ({folder.name}, {size_gb:.2f} GB, bf16, greedy)",
        "",
        "| arm | median ms/token | per round | tok/s |",
        "|---|---|---|---|",
    ]
    for arm in ARMS:
        md.append(f"| {arm} | {med[arm]:.1f} | {result['per_round_ms'][arm]} | {1000 / med[arm]:.1f} |")
    md += ["", f"sluice is {result['speedup']}x faster; identical greedy tokens: {identical}.", "",
           f"Command: `{result['command']}`", ""]
    (OUT / "resident_decode.md").write_text("\n".join(md))
    print("\n".join(md))


def prefill(a) -> None:
    model = a.model or str(ROOT / "benchmarks" / "models" / "qwen3_moe-1GiB")
    rows, result = [], {"model": Path(model).name, "rounds": a.rounds, "prompts": {}}
    for n in a.prompts:
        runs = run_arms(model, 2, n, a.rounds,
                        lambda r, arm, res, n=n: f"{n} tokens, round {r} {arm}: {res['prefill_ms']:.0f} ms")
        med = {arm: statistics.median(x["prefill_ms"] for x in runs[arm]) for arm in ARMS}
        same = all(x["tokens"] == runs["sluice"][0]["tokens"] for arm in ARMS for x in runs[arm])
        result["prompts"][n] = {"median_prefill_ms": {k: round(v, 1) for k, v in med.items()},
                                "tok_s": {k: round(1000 * n / v, 1) for k, v in med.items()},
                                "speedup": round(med["transformers"] / med["sluice"], 2), "same_tokens": same}
        rows.append(f"| {n} | {1000 * n / med['sluice']:.0f} | {1000 * n / med['transformers']:.0f} | "
                    f"{med['transformers'] / med['sluice']:.2f}x | {same} |")
    result["command"] = "python benchmarks/resident.py " + " ".join(sys.argv[1:])
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "resident_prefill.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# Resident prefill: sluice vs transformers ({result['model']}, bf16, medians of {a.rounds} rounds)", "",
          "| prompt tokens | sluice tok/s | transformers tok/s | sluice vs transformers | same next tokens |",
          "|---|---|---|---|---|", *rows, "", f"Command: `{result['command']}`", ""]
    (OUT / "resident_prefill.md").write_text("\n".join(md))
    print("\n".join(md))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True, metavar="{decode,prefill}")
    d = sub.add_parser("decode", help="median ms/token of a greedy decode")
    d.add_argument("--size", default="1GiB")
    d.add_argument("--model", default=None, help="existing model folder (default: build one in benchmarks/models)")
    d.add_argument("--rounds", type=int, default=3)
    d.add_argument("--tokens", type=int, default=32)
    d.add_argument("--prompt-len", type=int, default=16)
    p = sub.add_parser("prefill", help="prefill tok/s of seeded prompts")
    p.add_argument("--model", default=None, help="model folder (default: benchmarks/models/qwen3_moe-1GiB)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, nargs="+", default=[512, 2048])
    c = sub.add_parser("child", help=argparse.SUPPRESS)
    c.add_argument("arm", choices=ARMS)
    c.add_argument("folder")
    c.add_argument("--tokens", type=int, required=True)
    c.add_argument("--prompt-len", type=int, required=True)
    a = ap.parse_args()
    if a.what == "child":
        print(json.dumps(child(a.arm, a.folder, a.tokens, a.prompt_len)))
    else:
        {"decode": decode, "prefill": prefill}[a.what](a)


if __name__ == "__main__":
    main()
