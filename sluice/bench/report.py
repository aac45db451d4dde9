"""What a bench run leaves behind: the markdown table (stdout and results.md), results.json, latency.png."""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path
from typing import Any

from ..host.cpus import cpu_line
from ..units import format_bytes
from .protocol import Run, identity_text, wins_text

DASH = "—"


def _num(x: float | None, spec: str = ".1f") -> str:
    return DASH if x is None else format(x, spec)


def _size(x: float | None) -> str:
    return DASH if x is None else format_bytes(x)


def _pair(before: float | None, after: float | None, spec: str = ".2f") -> str:
    """'12.31 / 11.80': a figure measured before the rounds and after them."""
    if before is None and after is None:
        return DASH
    return f"{_num(before, spec)} / {_num(after, spec)}"


def _arm_cell(name: str, s: dict[str, Any], reference: str) -> str:
    notes = []
    if name == reference:
        notes.append("ref")
    if s["oom_runs"] and s["ok_runs"]:
        notes.append(f"OOM {s['oom_runs']}/{s['runs']}")
    if "died of" in s.get("repacking", ""):  # peers.repacking_note of a fallback
        notes.append("defaults crashed: repacking off")
    return f"{name} ({', '.join(notes)})" if notes else name


COLUMNS = ["arm", "ms/step", "p90", "tok/s", "vs ref", "paired wins", "prefill ms", "prefill tok/s", "prefill read",
           "CPU ms/step", "peak RSS",
           "major flt/step", "minor flt/step", "read/step", "disk read/step", "hit rate", "I/O wait ms/step",
           "floor ms before / after", "step/floor", "argmax vs ref"]


def table(results: dict[str, Any]) -> str:
    """The markdown table: one row per arm, in the order given (the reference first)."""
    ref = results["arms"][0]["name"]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for arm in results["arms"]:
        name = arm["name"]
        s = results["summary"][name]
        ident = identity_text(results["identity"]["arms"].get(name))
        if not s["ok_runs"]:
            why = f"OOM ({s['oom_runs']}/{s['runs']} rounds)" if s["oom_runs"] == s["runs"] else (
                "failed: " + "; ".join(s["errors"])[:120].replace("|", "/"))
            lines.append(f"| {_arm_cell(name, s, ref)} | {why} |" + f" {DASH} |" * (len(COLUMNS) - 2))
            continue
        p = s.get("pair") or {}
        cells = [
            _arm_cell(name, s, ref),
            _num(s["step_ms_median"], ".2f"),
            _num(s["step_ms_p90"], ".2f"),
            _num(s["tok_s"], ".2f"),
            DASH if name == ref or p.get("ratio_median") is None else f"{p['ratio_median']:.3f}x",
            DASH if name == ref else wins_text(p),
            _num(s["prefill_ms"]),
            _num(s.get("prefill_tok_s"), ".1f"),
            _size(s.get("prefill_read_bytes")),
            _num(s["cpu_ms_per_step"], ".2f"),
            _size(s["peak_rss_bytes"]),
            _num(s["major_faults_per_step"]),
            _num(s["minor_faults_per_step"]),
            _size(s["bytes_read_per_step"]),
            _size(s["disk_read_bytes_per_step"]),
            DASH if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f}%",
            _num(s["io_wait_ms_per_step"], ".2f"),
            _pair(s.get("floor_ms_before"), s.get("floor_ms_after")),
            _num(s["step_floor_ratio"], ".2f"),
            ident,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def header(results: dict[str, Any]) -> str:
    """One paragraph saying what was measured, so a pasted table keeps its conditions."""
    m = results["meta"]
    floor = results.get("floor")
    parts = [
        f"model `{m['model']}`",
        f"{m['rounds']} rounds x {len(results['arms'])} arms (rotated, fresh process each)",
        f"{m['warmup']} untimed + {m['steps']} timed decode steps after a {m['prompt_tokens']}-token prompt",
        "sampled" + f" (T={m['temperature']}, seed {m['seed']})" if m["temperature"] else "greedy",
        {"cold": "verified cold (mincore <= 1% before each run)", "warm": "warm page cache"}.get(
            m["page_cache"], "page cache as found"),
        f"memory ceiling {format_bytes(m['ceiling'])} (cgroup, page cache included)" if m["ceiling"] else
        "no memory ceiling",
        "I/O floor measured in this run, before the first round and after the last (below)" if floor is not None
        else "no floor (--no-floor)",
    ]
    if m.get("context"):
        parts.append(f"a KV cache of {m['context']} positions (prompt + steps + 16, as the llama.cpp arm's n_ctx) "
                     "for every sluice arm that does not set --max-context")
    if m.get("cpu"):
        parts.append(f"CPU {cpu_line(m['cpu'])}")
    if m.get("commit"):
        parts.append(f"sluice at {m['commit']}")
    arms = "; ".join(f"**{a['name']}** `{a['flags'] or '(defaults)'}`" for a in results["arms"])
    return ", ".join(parts) + ".\nArms: " + arms + ". Ratios and wins are paired per round against the first arm."


def prefetch_table(results: dict[str, Any]) -> str:
    """Prefetch counters (medians over rounds, whole run) for the arms that prefetched; "" when none did."""
    rows = []
    for arm in results["arms"]:
        s = results["summary"][arm["name"]]
        if not s.get("prefetch_issued"):
            continue
        rows.append(
            f"| {arm['name']} | {100 * s.get('prefetch_recall', 0):.1f}% | {100 * s.get('prefetch_precision', 0):.1f}% "
            f"| {s['prefetch_issued']:.0f} | {s.get('prefetch_wasted', 0):.0f} | {_size(s.get('prefetch_wasted_bytes'))} "
            f"| {s.get('prefetch_paused', 0):.0f} |"
        )
    if not rows:
        return ""
    head = ("| arm | recall (predicted & true / true) | precision (used / issued) | experts prefetched | wasted "
            "| wasted bytes | paused calls |\n|---|---|---|---|---|---|---|")
    return "\n\nPrefetch, per run (medians over rounds):\n\n" + head + "\n" + "\n".join(rows)


def _reader_text(spec: dict[str, Any]) -> str:
    """'direct, 8 workers, native threads, O_DIRECT' / 'direct, 8 reads in flight, io_uring, O_DIRECT' / 'mmap'."""
    if spec["mode"] != "direct":
        return spec["mode"]
    odirect = "O_DIRECT" if spec["odirect"] else "buffered"
    if spec.get("engine") == "uring":  # one thread: `workers` is the reads it keeps in flight
        return f"direct, {spec['workers']} reads in flight, io_uring, {odirect}"
    engines = {"native": ", native threads", "python": ", python threads"}
    return f"direct, {spec['workers']} workers{engines.get(spec.get('engine'), '')}, {odirect}"


def _paired(s: dict[str, Any]) -> str:
    """'**1.12** (1.05 / 1.12 / 1.30; floors 120 / 98 / 131)': the median of the per-round ratios, then each."""
    ratios = s.get("step_floor_rounds")
    if not ratios:
        return DASH
    each = " / ".join(f"{r:.2f}" for r in ratios)
    floors = " / ".join(f"{f:.0f}" for f in s["floor_ms_rounds"])
    return f"**{s['step_floor_paired']:.2f}** ({each}; floors {floors})"


def floor_table(results: dict[str, Any]) -> str:
    """How each arm's floor was measured and what it gave, before and after the rounds (and, with
    --floor-each-round, after its run in each round); "" without floors."""
    floor = results.get("floor")
    if not floor:
        return ""
    paired = int(any(f.get("rounds") for f in floor.values()))
    rows = []
    for arm in results["arms"]:
        f = floor.get(arm["name"])
        if f is None:
            continue
        s = results["summary"][arm["name"]]
        p = f.get("plan_summary")
        if p is None:
            why = "; ".join(f["errors"] + f.get("oom", []))[:160].replace("|", "/")
            rows.append(f"| {arm['name']} | no plan: {why} |" + f" {DASH} |" * (6 + paired))
            continue
        gbs = [(f.get(w) or {}).get("bytes_per_s") for w in ("before", "after")]
        rows.append(
            f"| {arm['name']} | {', '.join(_reader_text(r) for r in p['readers'])} "
            f"| {_size(p['bytes_per_step'])} in {_num(p['reads_per_step'], '.0f')} reads "
            f"| {_pair(s.get('floor_ms_before'), s.get('floor_ms_after'))} "
            f"| {_pair(*(None if g is None else g / 1e9 for g in gbs))} "
            f"| {_pair(s.get('step_floor_before'), s.get('step_floor_after'))} "
            f"| {_pair(s.get('prefill_floor_ms_before'), s.get('prefill_floor_ms_after'), '.1f')} "
            f"| {_size(p['prefill_bytes'])} |" + (f" {_paired(s)} |" if paired else ""))
    head = ("| arm | reader | reads per timed step | floor ms/step before / after | GB/s before / after "
            "| step/floor before / after | prompt floor ms before / after | prompt reads |"
            + (" step/floor paired by round (floor ms) |" if paired else "") + "\n" + "|---" * (8 + paired) + "|")
    m = results["meta"]
    state = ("read into the page cache first, as the arms' were" if m["page_cache"] == "warm" else
             "the model's files evicted and verified cold first")
    ceiling = f" under the same {format_bytes(m['ceiling'])} ceiling" if m.get("ceiling") else ""
    return ("\n\nI/O floor: each arm's own reads (the file ranges its readers read in an untimed replay of the same "
            f"work, per step) replayed in a fresh process{ceiling} with readers made like the arm's, {state}, each "
            "step's reads in flight together; the floor of a step is the timed steps' replay time / their number, "
            "measured before the first round and after the last. The main table's step/floor divides by the faster "
            "of the two." + (" Paired: each round's run against its own reads replayed right after it (the disk at "
                             "the same moment), the median of the rounds' ratios, then each round's."
                             if paired else "") + "\n\n" + head + "\n" + "\n".join(rows))


def peers_note(results: dict[str, Any]) -> str:
    """The best arm of each peer kind at decode and at the prompt, sluice's best against it, and which llama.cpp each
    llama.cpp arm ran (its defaults, repacking off, or repacking off after the defaults crashed); "" without peers."""
    lines = []
    for kind, b in (results.get("peers") or {}).items():
        parts = []
        d, p = b.get("decode"), b.get("prefill")
        if d:
            vs = (f" (sluice's best, {d['sluice_arm']}: {d['sluice_step_ms']:.2f} ms/step, {d['sluice_vs_best']:.2f}x "
                  f"{d['arm']}'s tokens/s)" if "sluice_vs_best" in d else "")
            parts.append(f"decode **{d['arm']}** {d['step_ms']:.2f} ms/step{vs}")
        if p:
            vs = (f" (sluice's best, {p['sluice_arm']}: {p['sluice_prefill_tok_s']:.1f} tok/s, "
                  f"{p['sluice_vs_best']:.2f}x {p['arm']}'s)" if "sluice_vs_best" in p else "")
            parts.append(f"prompt **{p['arm']}** {p['prefill_tok_s']:.1f} tok/s{vs}")
        lines.append(f"Best {kind} arm of {len(b['arms'])} ({', '.join(b['arms'])}): " + "; ".join(parts) + ".")
    notes = [f"**{a['name']}** {results['summary'][a['name']]['repacking']}" for a in results["arms"]
             if results["summary"][a["name"]].get("repacking")]
    if notes:
        lines.append("llama.cpp arms: " + "; ".join(notes) + ".")
    return "\n\n" + "\n\n".join(lines) if lines else ""


def markdown(results: dict[str, Any]) -> str:
    """The conditions paragraph and the table(s), as printed on stdout and written to results.md."""
    return (header(results) + "\n\n" + table(results) + peers_note(results) + floor_table(results)
            + prefetch_table(results) + "\n")


def write_json(results: dict[str, Any], path: Path) -> None:
    """results.json: conditions, arms, the replayed sequence, every run's child record, summaries, identity."""
    path.write_text(json.dumps(results, indent=1, default=str))


def plot(results: dict[str, Any], path: Path) -> None:
    """latency.png: each arm's timed decode steps (every round pooled) as a box with the points strewn over it, and
    the arm's I/O floor as a red bar. Arms without a successful run are labelled, not dropped."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the file is the output
    import matplotlib.pyplot as plt

    names = [a["name"] for a in results["arms"]]
    runs = [Run(**r) for r in results["runs"]]
    data = [[ms for r in runs if r.arm == n for ms in r.step_ms()] for n in names]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(names) + 2), 4.5), dpi=120)
    xs = list(range(1, len(names) + 1))
    present = [(x, d) for x, d in zip(xs, data) if d]
    if present:
        ax.boxplot([d for _, d in present], positions=[x for x, _ in present], widths=0.5, showfliers=False,
                   medianprops={"color": "black"})
    jitter = random.Random(0)  # fixed: the same results draw the same picture
    floor_drawn = False
    for x, n, d in zip(xs, names, data):
        if d:
            ax.scatter([x + jitter.uniform(-0.18, 0.18) for _ in d], d, s=6, alpha=0.35, color="tab:blue")
        else:
            s = results["summary"][n]
            ax.annotate("OOM" if s["oom_runs"] else "failed", (x, 0), xycoords=("data", "axes fraction"),
                        xytext=(0, 12), textcoords="offset points", ha="center", color="tab:red")
        f = results["summary"][n].get("floor_ms")
        if f is not None:
            ax.hlines(f, x - 0.3, x + 0.3, colors="tab:red", linewidth=2.5,
                      label=None if floor_drawn else "I/O floor (the arm's reads replayed cold; the faster of "
                                                     "before / after)")
            floor_drawn = True
    ax.set_xticks(xs, names)
    ax.set_xlim(0.4, len(names) + 0.6)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("decode ms / step")
    m = results["meta"]
    cond = [m["page_cache"] or "", f"ceiling {format_bytes(m['ceiling'])}" if m["ceiling"] else ""]
    ax.set_title(f"{Path(m['model']).name}: {m['steps']} timed steps x {m['rounds']} rounds "
                 f"{' '.join(c for c in cond if c)}".strip(), fontsize=10)
    if floor_drawn:
        ax.legend(loc="best", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_all(results: dict[str, Any], out: Path) -> dict[str, Path]:
    """results.md, results.json and latency.png in `out` (created). On any error (a full disk) none of the three is
    left behind, half-written or not, nor `out` if this call created it."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "results.md", "json": out / "results.json", "png": out / "latency.png"}
    try:
        paths["md"].write_text(markdown(results))
        write_json(results, paths["json"])
        plot(results, paths["png"])
    except BaseException:
        for path in paths.values():
            path.unlink(missing_ok=True)
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    return paths
