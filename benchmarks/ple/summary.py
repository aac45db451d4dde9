"""The PLE benchmark's table (benchmarks/ple/run.sh writes the results this reads).

    .venv/bin/python benchmarks/ple/summary.py benchmarks/results/ple > benchmarks/results/ple/summary.md

Per prompt set and arm, medians over the rounds: distinct table rows read (sluice's ple_rows), the prefill's major page
faults (every thread), the PLE stage's seconds (sluice: time its gathers spent blocked on the table's reads,
ple_wait_s), the prompt's tokens/s, and the I/O floor of those rows: distinct rows / the disk's cold random-row
rate at the row reader's queue depth (16 workers, O_DIRECT, row_floor.py; the slowest of its measurements). Then
the verdicts of issue 31: direct's PLE stage against mmap's (>= 5x), direct's against its floor (<= 1.5x),
sluice's prompt against the best llama.cpp arm (>= 2x), and warm decode with the table on disk against it resident
(within 5%).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

WORKERS = 16  # the row tables' direct pool (io/direct.py ROW_WORKERS): the queue depth of the PLE reads


def med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def floor_rate(files: list[Path]) -> float | None:
    """Rows/s of the slowest of these floor measurements at WORKERS workers with O_DIRECT and the reader's
    default gap."""
    rates = [m["rows_per_s"] for f in files for m in json.loads(f.read_text())["measurements"]
             if m["workers"] == WORKERS and m["odirect"] and m.get("max_gap", 65536) == 65536]
    return min(rates) if rates else None


def arm_rows(res: dict) -> dict[str, dict]:
    """arm -> medians of what its successful runs recorded, or the reason none succeeded."""
    out: dict[str, dict] = {}
    for arm in (a["name"] for a in res["arms"]):
        runs = [r for r in res["runs"] if r["arm"] == arm]
        ok = [r["record"] for r in runs if r["record"] and not r["error"]]
        if not ok:
            out[arm] = {"error": runs[0]["error"] if runs else "no runs"}
            continue
        st = [r.get("stats") or {} for r in ok]
        out[arm] = {"runs": len(ok), "tokens": ok[0]["prefill_tokens"],
                    "prefill_s": med([r["prefill_s"] for r in ok]),
                    "faults": med([r.get("prefill_major_faults") for r in ok]),
                    "ple_rows": med([s.get("ple_rows") for s in st]),
                    "ple_s": med([s.get("ple_wait_s") for s in st])}
    return out


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def prompt_table(name: str, rows: dict[str, dict], rate: float | None) -> list[str]:
    lines = [f"### {name}", "", "| arm | runs | distinct rows | major faults | PLE s | floor s | prompt tok/s |",
             "|---|---|---|---|---|---|---|"]
    for arm, r in rows.items():
        if "error" in r:
            lines.append(f"| {arm} | 0 | {r['error']} | | | | |")
            continue
        floor = r["ple_rows"] / rate if rate and r["ple_rows"] else None
        lines.append(f"| {arm} | {r['runs']} | {fmt(r['ple_rows'], '.0f')} | {fmt(r['faults'], '.0f')} | "
                     f"{fmt(r['ple_s'], '.3f')} | {fmt(floor, '.3f')} | {r['tokens'] / r['prefill_s']:.1f} |")
    d, m = rows.get("direct", {}), rows.get("mmap", {})
    peers = [r["tokens"] / r["prefill_s"] for a, r in rows.items() if a.startswith("llama") and "error" not in r]
    verdicts = []
    if d.get("ple_s") and m.get("ple_s"):
        verdicts.append(f"PLE stage mmap / direct {m['ple_s'] / d['ple_s']:.1f}x (bar >= 5x)")
    if d.get("ple_s") and rate and d.get("ple_rows"):
        verdicts.append(f"direct / its floor {d['ple_s'] / (d['ple_rows'] / rate):.2f}x (bar <= 1.5x)")
    if d.get("prefill_s") and peers:
        verdicts.append(f"prompt vs best llama.cpp {d['tokens'] / d['prefill_s'] / max(peers):.2f}x (bar >= 2x)")
    elif d.get("prefill_s"):
        verdicts.append("no llama.cpp arm finished")
    return lines + ["", "; ".join(verdicts), ""]


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/ple")
    print(f"# PLE benchmark summary ({out})\n")
    for d in sorted(out.glob("prompt-*/results.json"), key=lambda p: int(p.parent.name.split("-")[1])):
        res, n = json.loads(d.read_text()), d.parent.name.split("-")[1]
        floors = sorted(out.glob(f"floor-{n}-*.json"))
        rate = floor_rate(floors)
        print("\n".join(prompt_table(f"{d.parent.name}: {res['meta']['ceiling'] / 2**30:.0f} GiB ceiling, cold, "
                                     f"{res['meta']['cpu']['model']}", arm_rows(res), rate)))
        print(f"Floor: {fmt(rate, '.0f')} rows/s: the slowest of {len(floors)} cold replay(s) of the prompt's own "
              f"distinct rows, each pass's in one batch, {WORKERS} workers, O_DIRECT (row_floor.py, after the set)."
              f"\n")
    dec = out / "decode/results.json"
    if dec.is_file():
        s = json.loads(dec.read_text())["summary"]
        a, b = s.get("table-direct", {}), s.get("table-resident", {})
        if a.get("step_ms_median") and b.get("step_ms_median"):
            print(f"### decode, warm\n\ntable on disk {a['step_ms_median']:.2f} ms/token, resident "
                  f"{b['step_ms_median']:.2f}: {a['step_ms_median'] / b['step_ms_median'] - 1:+.1%} (bar within 5%)")


if __name__ == "__main__":
    main()
