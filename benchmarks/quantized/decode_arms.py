"""Resident decode of a quantized GGUF in three arms, alternated in one process (issue 14): the default
(`--activations int16`, native decode attention and router), the same model with the torch attention steps, and
`--activations int8` (llama.cpp's one-plane activation coding). Prints each round's decode ms/token (median of the
replay's steps), the medians, and each arm's teacher-forced decode logits against a float32 run of the same file
(relative L2, greedy agreement), so a speed-up is quoted with what it costs.

    PYTHONPATH=. .venv/bin/python benchmarks/quantized/decode_arms.py [GGUF] [--rounds 4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import statistics

import torch

import sluice


def decode_logits(m, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits of each teacher-forced decode step (one token at a time after the prompt), [len(tokens), V]."""
    with torch.inference_mode():
        m.model.forward(torch.tensor(prompt), 0)
        return torch.cat([m.model.logits(m.model.forward(torch.tensor([t]), p))
                          for p, t in enumerate(tokens, len(prompt))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="benchmarks/models/qwen3_moe-peers/model-Q4_K_M.gguf")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    prompt = [100, 101, 102, 103]
    tokens = torch.randint(200, 20000, (a.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    with sluice.load(a.model, memory="all", dtype="float32") as m:
        exact = decode_logits(m, prompt, tokens)
    m16 = sluice.load(a.model, memory="all", threads=2, activations="int16")
    m8 = sluice.load(a.model, memory="all", threads=2, activations="int8")
    arms = {"int16": (m16, True), "int16, torch attention": (m16, False), "int8": (m8, True)}
    times: dict[str, list[float]] = {k: [] for k in arms}
    quality = {}
    for name, (m, native) in arms.items():
        m.model.native_attention = native
        got = decode_logits(m, prompt, tokens)
        rel = ((got - exact).norm() / exact.norm()).item()
        quality[name] = (rel, (got.argmax(-1) == exact.argmax(-1)).float().mean().item())
        m.replay(prompt, tokens[:4])  # warm-up
    names = list(arms)
    for r in range(a.rounds):
        order = names[r % len(names):] + names[: r % len(names)]  # rotated
        for name in order:
            m, native = arms[name]
            m.model.native_attention = native
            m.replay(prompt, tokens)
            times[name].append(1000 * statistics.median(m.step_times.decode_s))
        print(f"round {r}: " + ", ".join(f"{n} {times[n][-1]:.1f}" for n in names), flush=True)
    for name in names:
        rel, agree = quality[name]
        print(f"{name}: median {statistics.median(times[name]):.1f} ms/token; decode logits vs float32: relative L2 "
              f"{rel:.2e}, greedy agreement {agree:.0%}")
    m16.close()
    m8.close()


if __name__ == "__main__":
    main()
