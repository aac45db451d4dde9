"""The issue-8 table from `sluice bench` results.json files: ms/token, ratio to sluice's best arm, faults, bytes,
peak RSS, identity. `python benchmarks/peers/table.py benchmarks/results/peers/*/results.json` (markdown)."""

from __future__ import annotations

import json
import sys

from sluice.options import format_bytes as size

LABELS = {"direct": "sluice direct", "direct+odirect": "sluice direct+odirect",
          "llama.cpp": "llama.cpp mmap (defaults)", "llama.cpp-norepack": "llama.cpp mmap, repacking off",
          "llama.cpp+random": "llama.cpp + MADV_RANDOM",
          "accelerate": "transformers + accelerate offload"}


def table(path: str) -> str:
    d = json.load(open(path))
    summary, ident = d["summary"], d["identity"]["arms"]
    sluice = {a: s for a, s in summary.items() if not a.startswith(("llama", "accel")) and s["ok_runs"]}
    best = min(sluice, key=lambda a: sluice[a]["step_ms_median"])
    best_ms = sluice[best]["step_ms_median"]
    meta = d["meta"]
    lines = [f"`{path}`: ceiling {size(meta['ceiling'])}" if meta.get("ceiling") else f"`{path}`", "",
             "| arm | ms/token (median) | vs sluice's best arm | major faults/token | disk read/token | hit rate | "
             "peak RSS | greedy tokens |", "|---|---|---|---|---|---|---|---|"]
    for arm, s in summary.items():
        name = LABELS.get(arm, arm)
        if "died of" in s.get("repacking", ""):  # the defaults crashed on this CPU: the bench ran repacking off
            name = name.replace(" (defaults)", "") + " (defaults crashed: repacking off)"
        if not s["ok_runs"]:
            lines.append(f"| {name} | OOM-killed ({s['oom_runs']}/{s['runs']} runs) | - | - | - | - | - | - |")
            continue
        ms = s["step_ms_median"]
        extra = f" ({s['step_floor_ratio']:.2f}x the I/O floor)" if s.get("step_floor_ratio") else ""
        a = ident.get(arm, {})
        n, bad = a.get("steps_compared", 0), a.get("mismatched_steps", 0)
        same = f"identical {n}/{n}" if n and not bad else f"{bad}/{n} steps differ"
        if arm == (d["identity"].get("reference") or {}).get("arm"):
            same = f"reference ({same} across rounds)"
        hit = f"{100 * s['hit_rate']:.1f}%" if s.get("hit_rate") is not None and arm in sluice else "-"
        lines.append(f"| {name} | {ms:,.0f}{extra} | {ms / best_ms:.1f}x | {s['major_faults_per_step']:,.0f} | "
                     f"{size(s['disk_read_bytes_per_step'])} | {hit} | {size(s['peak_rss_bytes'])} | {same} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(table(p) for p in sys.argv[1:]))
