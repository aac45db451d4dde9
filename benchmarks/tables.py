"""The markdown tables of the committed `sluice bench` runs, from their result folders (no timing here).

    python benchmarks/tables.py archs FOLDER...                  # issue 16, one row per architecture
    python benchmarks/tables.py peers RESULTS.json...            # issue 8, sluice vs llama.cpp vs accelerate
    python benchmarks/tables.py prefill MODEL STREAMED_DIR RESIDENT_DIR [--out FILE.md]   # issue 15's verdicts

archs: benchmarks/archs/run.sh writes benchmarks/results/archs/README.md with it. peers: the tables of
benchmarks/results/peers/NOTES.md (`python benchmarks/tables.py peers benchmarks/results/peers/*/results.json`).
prefill: benchmarks/prefill/run.sh, one <set>.md per file: STREAMED_DIR a cold run under a ceiling with arms `sluice`
and `llama.cpp*`, RESIDENT_DIR the same prompt resident and warm (arm `resident`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import sluice
from sluice.options import LoadOptions, format_bytes
from sluice.plan import plan


# -- archs (benchmarks/archs/run.sh) ---------------------------------------------------------------------------------
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


def arch_row(folder: str) -> str:
    d = json.loads((Path(folder) / "results.json").read_text())
    model = d["meta"]["model"]
    files, fmt, per_token = expert_facts(model)
    s = next(iter(d["summary"].values()))
    if not s.get("ok_runs"):
        return f"| {Path(folder).name} | {Path(model).name} | failed: {'; '.join(s.get('errors', []))[:80]} |"
    ident = next(iter(d["identity"]["arms"].values()), {})
    n, bad = ident.get("steps_compared", 0), ident.get("mismatched_steps", 0)
    return (f"| {Path(folder).name} | {format_bytes(files)} | {fmt} | "
            f"{format_bytes(per_token)} | {s['step_ms_median']:,.0f} | {format_bytes(s['bytes_read_per_step'])} | "
            f"{100 * s['hit_rate']:.1f}% | "
            f"{_f(s.get('floor_ms_before'), ',.0f')} / {_f(s.get('floor_ms_after'), ',.0f')} | "
            f"{_f(s['step_floor_ratio'], '.2f')} | "
            f"{format_bytes(s['peak_rss_bytes'])} | {n - bad}/{n} |")


def archs_table(folders: list[str]) -> str:
    """Issue 16's table (benchmarks/archs/run.sh): one row per `sluice bench` folder."""
    first = json.loads((Path(folders[0]) / "results.json").read_text())
    m = first["meta"]
    head = (f"# One streaming row per architecture: synthetic checkpoints, cold, {format_bytes(m['ceiling'])} ceiling, "
            f"{m['rounds']} rounds x {m['steps']} tokens (+{m['warmup']} untimed); the I/O floor is each run's own "
            "reads replayed cold with its reader before the first round and after the last, step/floor against the "
            "faster\n\n`bash benchmarks/archs/run.sh`\n")
    lines = ["| architecture | checkpoint | expert format | expert bytes/token | ms/token | read/token | hit rate | "
             "floor ms before / after | step/floor | peak RSS | greedy identical across rounds |", "|" + "---|" * 11]
    return head + "\n" + "\n".join(lines + [arch_row(f) for f in folders]) + "\n"


# -- peers (benchmarks/results/peers/NOTES.md) -----------------------------------------------------------------------
PEER_LABELS = {"direct": "sluice direct", "direct+odirect": "sluice direct+odirect",
               "llama.cpp": "llama.cpp mmap (defaults)", "llama.cpp-norepack": "llama.cpp mmap, repacking off",
               "llama.cpp+random": "llama.cpp + MADV_RANDOM",
               "accelerate": "transformers + accelerate offload"}


def peers_table(path: str) -> str:
    """Issue 8's table of one results.json (benchmarks/peers/run.sh)."""
    d = json.load(open(path))
    summary, ident = d["summary"], d["identity"]["arms"]
    sluice = {a: s for a, s in summary.items() if not a.startswith(("llama", "accel")) and s["ok_runs"]}
    best = min(sluice, key=lambda a: sluice[a]["step_ms_median"])
    best_ms = sluice[best]["step_ms_median"]
    meta = d["meta"]
    lines = [f"`{path}`: ceiling {format_bytes(meta['ceiling'])}" if meta.get("ceiling") else f"`{path}`", "",
             "| arm | ms/token (median) | vs sluice's best arm | major faults/token | disk read/token | hit rate | "
             "peak RSS | greedy tokens |", "|---|---|---|---|---|---|---|---|"]
    for arm, s in summary.items():
        name = PEER_LABELS.get(arm, arm)
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
                     f"{format_bytes(s['disk_read_bytes_per_step'])} | {hit} | {format_bytes(s['peak_rss_bytes'])} | "
                     f"{same} |")
    return "\n".join(lines)


# -- prefill (benchmarks/prefill/run.sh) -----------------------------------------------------------------------------
def touched_bytes(model: str, prompt: list[int], chunk: int) -> tuple[int, int]:
    """(touched (layer, expert) pairs, their bytes) when `prompt` is prefilled in chunks of `chunk` tokens: a pair
    counts once per chunk that routes to it (what an ideal expert-major prefill must read)."""
    with sluice.load(model, memory="all", prefill_chunk=chunk) as m:
        seen: set[tuple[int, int, int]] = set()
        acquire, chunk_no = m.store.acquire, [0]
        forward = m.model.forward

        def counting_forward(tokens, pos):
            chunk_no[0] = pos // chunk
            return forward(tokens, pos)

        m.model.forward = counting_forward
        m.store.acquire = lambda L, ids: (seen.update((chunk_no[0], L, e) for e in ids), acquire(L, ids))[1]
        m.replay(prompt, [])  # the prompt's forward passes, logits of its last position only
        return len(seen), len(seen) * m.layout.expert_nbytes


def runs(folder: str) -> tuple[dict, dict[str, list[dict]]]:
    """(results.json of a `sluice bench` folder, the records of its successful runs by arm)."""
    res = json.loads((Path(folder) / "results.json").read_text())
    by_arm: dict[str, list[dict]] = {}
    for r in res["runs"]:
        if r.get("record") and not r.get("error"):
            by_arm.setdefault(r["arm"], []).append(r["record"])
    return res, by_arm


def prefill_table(model: str, streamed: str, resident: str) -> str:
    """Issue 15's verdicts (benchmarks/prefill/run.sh): STREAMED a cold run under a ceiling with arms `sluice` and
    the llama.cpp ones, RESIDENT the same prompt with everything resident and warm (arm `resident`: the compute
    time). The touched experts are counted here by routing the same prompt ids once through a resident model (every
    (layer, expert) pair the router picks), so the bytes claim does not rest on the store's own counters."""
    res, st = runs(streamed)
    _, rs = runs(resident)
    prompt = res["sequence"]["prompt_ids"]
    n = len(prompt)
    sl, rr = st["sluice"], rs["resident"]
    # llama.cpp run three ways (defaults, repacking off, MADV_RANDOM): each arm's prompt, and sluice against the best
    llama = {a["name"]: st[a["name"]] for a in res["arms"] if a.get("peer") == "llama.cpp" and a["name"] in st}
    chunk = sl[0]["stats"].get("prefill_chunk") or n
    pairs, touched = touched_bytes(model, prompt, min(chunk, n))
    whole_pairs, whole = touched_bytes(model, prompt, n) if chunk < n else (pairs, touched)
    med = statistics.median
    t_stream = med(r["prefill_s"] for r in sl)
    t_compute = med(r["prefill_s"] for r in rr)
    read = med(r["prefill_bytes_read"] for r in sl)
    disk = med(r["prefill_disk_read_bytes"] for r in sl)
    # the floor of the prompt: sluice's own prompt reads replayed cold with its reader, in the same bench run, before
    # the first round and after the last (bench/floor.py); the bound uses the faster
    fl = (res.get("floor") or {}).get("sluice") or {}
    io_ms = [(fl.get(w) or {}).get("prefill_floor_ms") for w in ("before", "after")]
    t_io = min(x for x in io_ms if x is not None) / 1000 if any(x is not None for x in io_ms) else None
    bound = max(t_compute, t_io or 0)
    lines = [f"# Streamed prefill of a {n}-token prompt: `{Path(model).name}` at a "
             f"{format_bytes(res['meta']['ceiling'])} ceiling, cold, medians of {len(sl)} rounds", "",
             "| measure | value |", "|---|---|",
             f"| sluice prefill | {1000 * t_stream:.0f} ms = {n / t_stream:.1f} tok/s |",
             f"| resident compute (warm, no ceiling) | {1000 * t_compute:.0f} ms = {n / t_compute:.1f} tok/s |",
             f"| bytes read by the store / disk | {format_bytes(read)} / {format_bytes(disk)} |",
             f"| prefill chunk (`--prefill-chunk auto`) | {min(chunk, n)} tokens |",
             f"| touched experts, once per chunk (routing the same ids) | {pairs} x expert = {format_bytes(touched)} |",
             f"| **read / touched per chunk** | **{read / touched:.3f}** |",
             f"| touched experts, once per prompt | {whole_pairs} x expert = {format_bytes(whole)} |",
             f"| **read / touched per prompt** (<= 1.1) | **{read / whole:.3f}** |"]
    if t_io is not None:
        ms = " / ".join("-" if x is None else f"{x:.0f}" for x in io_ms)
        lines += [f"| prompt floor: sluice's prompt reads replayed cold, before / after the rounds | {ms} ms |",
                  f"| **prefill / max(compute, prompt floor)** (<= 1.3) | **{t_stream / bound:.2f}** |"]
    t_ll = {name: med(r["prefill_s"] for r in recs) for name, recs in llama.items()}
    for name, recs in llama.items():
        ll_disk = med(r.get("prefill_disk_read_bytes") or 0 for r in recs)
        how = res["summary"][name].get("repacking") or "llama.cpp"
        lines.append(f"| {name} prefill (mmap, n_batch 512; {how}) | {1000 * t_ll[name]:.0f} ms = "
                     f"{n / t_ll[name]:.1f} tok/s, disk read {format_bytes(ll_disk)} |")
    if t_ll:
        best = min(t_ll, key=t_ll.get)
        lines.append(f"| **sluice vs the best llama.cpp arm ({best}) prefill tok/s** (>= 3) | "
                     f"**{t_ll[best] / t_stream:.2f}x** |")
        ident = res["identity"]["arms"].get(best)
        if ident:
            lines.append(f"| first token after the prompt, {best} vs sluice | "
                         f"{ident.get('steps_compared', 0) - ident.get('mismatched_steps', 0)}/"
                         f"{ident.get('steps_compared', 0)} steps agree |")
    lines += ["", f"From `{streamed}` and `{resident}` (`sluice bench` results); "
              f"command: `bash benchmarks/prefill/run.sh`.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="table", required=True)
    sub.add_parser("archs", help="one row per `sluice bench` folder").add_argument("folders", nargs="+")
    sub.add_parser("peers", help="one table per results.json").add_argument("results", nargs="+")
    p = sub.add_parser("prefill", help="the streamed prefill's verdicts")
    p.add_argument("model")
    p.add_argument("streamed")
    p.add_argument("resident")
    p.add_argument("--out")
    a = ap.parse_args()
    if a.table == "archs":
        print(archs_table(a.folders))
    elif a.table == "peers":
        print("\n\n".join(peers_table(p) for p in a.results))
    else:
        text = prefill_table(a.model, a.streamed, a.resident)
        print(text)
        if a.out:
            Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
