"""The issue-16 table from `sluice bench` result folders (benchmarks/archs/run.sh): one row per architecture.

    python benchmarks/archs/table.py benchmarks/results/archs/gpt_oss benchmarks/results/archs/glm4_moe ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sluice.options import LoadOptions
from sluice.options import format_bytes as size
from sluice.plan import plan


def expert_facts(model: str) -> tuple[int, str, int]:
    """(checkpoint bytes on disk, the experts' stored format, expert bytes one token reads) of `model`."""
    p = plan(model, LoadOptions.make(memory="all"))
    files = sum(Path(f).stat().st_size for f in p.index.files)
    moe = p.layout.layers
    fmt = p.layout.format(moe[0])
    names = sorted({getattr(fmt, k).name for k in ("gate", "up", "down") if getattr(fmt, k, None) is not None})
    return files, "/".join(names) or "?", p.layout.expert_nbytes * p.spec.top_k * len(moe)


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def row(folder: str) -> str:
    d = json.loads((Path(folder) / "results.json").read_text())
    model = d["meta"]["model"]
    files, fmt, per_token = expert_facts(model)
    s = next(iter(d["summary"].values()))
    if not s.get("ok_runs"):
        return f"| {Path(folder).name} | {Path(model).name} | failed: {'; '.join(s.get('errors', []))[:80]} |"
    ident = next(iter(d["identity"]["arms"].values()), {})
    n, bad = ident.get("steps_compared", 0), ident.get("mismatched_steps", 0)
    return (f"| {Path(folder).name} | {size(files)} | {fmt} | "
            f"{size(per_token)} | {s['step_ms_median']:,.0f} | {size(s['bytes_read_per_step'])} | "
            f"{100 * s['hit_rate']:.1f}% | "
            f"{_f(s.get('floor_ms_before'), ',.0f')} / {_f(s.get('floor_ms_after'), ',.0f')} | "
            f"{_f(s['step_floor_ratio'], '.2f')} | "
            f"{size(s['peak_rss_bytes'])} | {n - bad}/{n} |")


def main(folders: list[str]) -> str:
    first = json.loads((Path(folders[0]) / "results.json").read_text())
    m = first["meta"]
    head = (f"# One streaming row per architecture: synthetic checkpoints, cold, {size(m['ceiling'])} ceiling, "
            f"{m['rounds']} rounds x {m['steps']} tokens (+{m['warmup']} untimed); the I/O floor is each run's own "
            "reads replayed cold with its reader before the first round and after the last, step/floor against the "
            "faster\n\n`bash benchmarks/archs/run.sh`\n")
    lines = ["| architecture | checkpoint | expert format | expert bytes/token | ms/token | read/token | hit rate | "
             "floor ms before / after | step/floor | peak RSS | greedy identical across rounds |", "|" + "---|" * 11]
    return head + "\n" + "\n".join(lines + [row(f) for f in folders]) + "\n"


if __name__ == "__main__":
    print(main(sys.argv[1:]))
