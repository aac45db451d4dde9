"""Issue 15's streamed-prefill verdicts from two `sluice bench` result folders (benchmarks/prefill/run.sh).

    python benchmarks/prefill/table.py MODEL STREAMED_DIR RESIDENT_DIR [--out FILE.md]

STREAMED_DIR: a cold run under a ceiling with arms `sluice` and `llama.cpp`; RESIDENT_DIR: the same prompt with
everything resident and warm (arm `resident`: the compute time). The touched experts are counted here by routing the
same prompt ids once through a resident model (every (layer, expert) pair the router picks), so the bytes claim does
not rest on the store's own counters.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import sluice
from sluice.options import format_bytes


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("streamed")
    ap.add_argument("resident")
    ap.add_argument("--out")
    a = ap.parse_args()
    res, st = runs(a.streamed)
    _, rs = runs(a.resident)
    prompt = res["sequence"]["prompt_ids"]
    n = len(prompt)
    sl, rr = st["sluice"], rs["resident"]
    # llama.cpp run three ways (defaults, repacking off, MADV_RANDOM): each arm's prompt, and sluice against the best
    llama = {a["name"]: st[a["name"]] for a in res["arms"] if a.get("peer") == "llama.cpp" and a["name"] in st}
    chunk = sl[0]["stats"].get("prefill_chunk") or n
    pairs, touched = touched_bytes(a.model, prompt, min(chunk, n))
    whole_pairs, whole = touched_bytes(a.model, prompt, n) if chunk < n else (pairs, touched)
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
    lines = [f"# Streamed prefill of a {n}-token prompt: `{Path(a.model).name}` at a "
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
    lines += ["", f"From `{a.streamed}` and `{a.resident}` (`sluice bench` results); "
              f"command: `bash benchmarks/prefill/run.sh`.", ""]
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
