"""The I/O floor of a PLE pass on this disk (issue 31): how fast random rows of the n-gram table come off the disk
cold, read by sluice's own direct reader (the pool `--ple direct` uses), at each queue depth.

    .venv/bin/python benchmarks/ple/row_floor.py MODEL.gguf --from RESULTS.json [--workers 8 16 32] [--out F.json]
    .venv/bin/python benchmarks/ple/row_floor.py MODEL.gguf --rows 20000 ...   # uniform random rows instead

For each worker count and reader setting: the model file evicted from the page cache and checked cold with mincore,
then the rows read as the PLE stage reads them: `--from` a `sluice bench` results.json, the exact rows of its prompt
(sequence.prompt_ids, hashed by the model's own PLE code, in passes of the direct arm's prefill chunk, each pass's
distinct rows sorted and read in one batch); `--rows N`, N uniform random distinct rows in one batch (the hash spreads
a prompt's rows over the table). With O_DIRECT each row costs its enclosing 4 KiB-aligned block, buffered its page plus
the kernel's readahead; max_gap 64 KiB (the direct pool's default) reads through gaps up to 64 KiB between rows, 0
reads only the rows' blocks. Prints and saves seconds, rows/s and the bytes the disk delivered (/proc/self/io):
the floor the benchmark's PLE seconds are compared with (benchmarks/ple/run.sh runs this after each prompt set).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from sluice.checkpoint.gguf import read_gguf
from sluice.host.procstat import disk_read_bytes
from sluice.io import ReadRange
from sluice.io.direct import DirectReader
from sluice.io.ranges import DEFAULT_MAX_GAP
from sluice.io.residency import evict, resident_fraction

TABLE = "per_layer_token_embd.weight"  # llama.cpp's name of qwen4exp's n-gram table


def table_ref(path: Path):
    tensors = read_gguf(path).tensors
    if TABLE in tensors:
        return tensors[TABLE]
    raise SystemExit(f"error: {path}: no tensor {TABLE} (a qwen4exp GGUF from llama.cpp's converter has it)")


def prompt_rows(model: Path, results: Path) -> list[list[int]]:
    """Each prefill pass's distinct rows (ascending) of the bench run in `results`: its prompt ids hashed by the
    model's PLE block, in passes of the direct arm's prefill chunk."""
    import sluice
    from sluice.models.layers.ple import ngram_rows

    res = json.loads(results.read_text())
    ids = torch.tensor(res["sequence"]["prompt_ids"], dtype=torch.int64)
    chunk = next(r["record"]["stats"]["prefill_chunk"] for r in res["runs"] if r["arm"] == "direct" and r["record"])
    with sluice.load(model, ple="direct", memory="1GiB") as m:
        ple = next(layer.ple for layer in m.model.layers if getattr(layer, "ple", None) is not None)
        p, hist, out = ple.p, torch.full((ple.p.context,), ple.p.eos_token_id, dtype=torch.int64), []
        for i in range(0, len(ids), chunk):
            hist = torch.cat([hist[hist.shape[0] - p.context :], ids[i : i + chunk]])
            rows = ngram_rows(hist, p.context, p.eos_token_id, ple.mult, ple.sizes, ple.offsets, p.heads_per_ngram)
            out.append(torch.unique(rows).tolist())
    return out


def timed_rows(path: Path, ref, passes: list[list[int]], workers: int, odirect: bool, max_gap: int) -> dict:
    """Read each pass's rows (sorted, distinct) of the table in one batch, the passes in turn, starting cold;
    seconds and bytes off the disk."""
    evict(path)
    cold = resident_fraction(path)
    if cold > 0.01:
        raise SystemExit(f"error: {path} is {cold:.1%} resident after eviction: close what maps it and rerun")
    rb, n = ref.row_nbytes, sum(map(len, passes))
    buf = memoryview(bytearray(max(map(len, passes)) * rb))
    reader = DirectReader(workers=workers, odirect=odirect, max_gap=max_gap)
    secs, disk = 0.0, 0
    try:
        for ids in passes:
            reqs = [(ReadRange(ref.path, ref.offset + r * rb, rb), buf[i * rb : (i + 1) * rb])
                    for i, r in enumerate(ids)]  # as RowTable._read_rows builds them
            d0, t0 = disk_read_bytes(), time.perf_counter()
            reader.read(reqs)
            secs, disk = secs + time.perf_counter() - t0, disk + disk_read_bytes() - d0
    finally:
        reader.close()
    return {"workers": workers, "odirect": odirect, "max_gap": max_gap, "passes": len(passes), "rows": n,
            "row_bytes": rb, "seconds": round(secs, 4), "rows_per_s": round(n / secs),
            "disk_bytes_per_row": round(disk / n), "resident_before": cold}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--from", dest="results", type=Path, help="a sluice bench results.json: its prompt's rows")
    src.add_argument("--rows", type=int, help="this many uniform random distinct rows")
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--gaps", type=int, nargs="+", default=[DEFAULT_MAX_GAP],
                    help="the reader's max_gap (bytes between two rows read through as one read; default the "
                         "direct pool's, 65536)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    ref = table_ref(a.model)
    rows = ref.shape[0]
    if a.results:
        passes, what = prompt_rows(a.model, a.results), f"the prompt of {a.results}"
    else:
        g = torch.Generator().manual_seed(a.seed)
        passes, what = [torch.randperm(rows, generator=g)[: min(a.rows, rows)].sort().values.tolist()], "random"
    print(f"{a.model}: {TABLE} [{rows} x {ref.shape[1]}] {ref.dtype}, {ref.row_nbytes} bytes a row; "
          f"{sum(map(len, passes))} distinct rows ({what}) in {len(passes)} passes, cold each time")
    out = []
    for gap in a.gaps:
        for odirect in (True, False):
            for w in a.workers:
                r = timed_rows(a.model, ref, passes, w, odirect, gap)
                out.append(r)
                print(f"  {'O_DIRECT' if odirect else 'buffered':8s} {w:3d} workers, max_gap {gap:6d}: "
                      f"{r['rows_per_s']:8d} rows/s ({r['seconds']:.3f} s), {r['disk_bytes_per_row']} disk bytes a row")
    result = {"model": str(a.model), "table": TABLE, "rows_from": str(a.results or "random"), "rows_in_table": rows, "cpu": platform.processor(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "measurements": out}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
