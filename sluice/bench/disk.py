"""`sluice bench --disk PATH`: the disk under a model, by access pattern -- a tool for looking at a disk, separate
from the bench's floor (floor.py replays each arm's own reads in the run that quotes it).

It writes a temporary file of random bytes next to PATH (same filesystem, same device), then reads it cold --
evicted and checked by mincore before each pattern -- with the reader sluice itself uses: sequential (8 MiB reads,
one worker) and random reads at expert-chunk sizes with 1..16 workers, each buffered and with O_DIRECT. The file is
deleted afterwards. The result is saved to $XDG_CACHE_HOME/sluice/disk-<st_dev>.json (~/.cache when unset) for
reference; nothing reads it back (a figure from another day is not the disk's rate during a run: the same disk
gave 0.83 and 2.28 GB/s 18 minutes apart).
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..io import DirectReader, ReadRange
from ..io.residency import evict, resident_fraction
from ..units import format_bytes
from . import BenchError
from ..host.procstat import disk_read_bytes

DEFAULT_SIZE = 1 << 30
WORKERS = (1, 2, 4, 8, 16)
# Expert-chunk sizes: 64 KiB ~ the scales of a 4-bit expert, 768 KiB one 4-bit projection of Qwen3-30B-A3B
# (768 x 2048 x 4 bit), 3 MiB one bf16 projection of the same shape.
CHUNKS = (64 << 10, 768 << 10, 3 << 20)
SEQ_READ = 8 << 20  # sequential read size: DirectReader's largest single read (ranges.DEFAULT_MAX_READ)
RANDOM_BYTES = 128 << 20  # bytes read per random configuration: ~0.1-0.5 s each at 0.3-1 GB/s
BATCH_BYTES = 32 << 20  # bytes submitted at once, ~ the misses of a couple of layers in one decode step

Log = Callable[[str], None]


def cache_dir() -> Path:
    """The user cache folder of sluice: $XDG_CACHE_HOME/sluice, else ~/.cache/sluice."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sluice"


def device_of(path: str | os.PathLike[str]) -> int:
    """st_dev of the filesystem holding `path` (a file or a folder)."""
    return os.stat(path).st_dev


def cache_path(dev: int) -> Path:
    """The cache file of device `dev` (st_dev)."""
    return cache_dir() / f"disk-{dev}.json"


def save(result: dict[str, Any]) -> Path:
    """Write `result` to its device's cache file atomically (a reader never sees half a file)."""
    path = cache_path(result["device"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)
    return path


def best(result: dict[str, Any]) -> dict[str, Any]:
    """The measurement with the highest bandwidth (bytes_per_s)."""
    return max(result["results"], key=lambda e: e["bytes_per_s"])


def describe(entry: dict[str, Any]) -> str:
    """'random 768 KiB x 8 workers O_DIRECT: 1.10 GB/s'."""
    kind = "sequential" if entry["pattern"] == "sequential" else f"random {format_bytes(entry['chunk'])}"
    mode = "O_DIRECT" if entry["odirect"] else "buffered"
    if entry.get("odirect_fallback"):
        mode += " (refused: buffered)"
    return f"{kind} x {entry['workers']} workers {mode}: {entry['bytes_per_s'] / 1e9:.2f} GB/s"


def _write_random(path: str, size: int) -> None:
    rng = np.random.default_rng(0)  # incompressible bytes: no layer underneath can shortcut them
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(64 << 20, left)
            f.write(rng.bytes(n))
            left -= n
        f.flush()
        os.fsync(f.fileno())


def _timed_read(path: str, ranges: Sequence[tuple[int, int]], workers: int, odirect: bool,
                batch_bytes: int) -> dict[str, Any]:
    """Read `ranges` ((offset, nbytes), in the given order) cold, in batches; bandwidth over the whole pass."""
    evict(path)
    cold = resident_fraction(path)
    per_batch = max(1, batch_bytes // ranges[0][1])
    # destinations allocated once and overwritten by every batch: the timing holds no allocation
    bufs = [torch.empty(n, dtype=torch.uint8) for _, n in ranges[:per_batch]]
    reader = DirectReader(workers=workers, odirect=odirect, max_gap=0)  # max_gap 0: no gap is read through
    try:
        io0 = disk_read_bytes()
        t0 = time.perf_counter()
        for i in range(0, len(ranges), per_batch):
            batch = ranges[i : i + per_batch]
            reader.read([(ReadRange(path, off, n), bufs[j]) for j, (off, n) in enumerate(batch)])
        seconds = time.perf_counter() - t0
        st = reader.stats()
    finally:
        reader.close()
    nbytes = sum(n for _, n in ranges)
    # odirect: what was asked; odirect_fallback: the filesystem refused it and the reads went buffered
    return {"workers": workers, "odirect": odirect, "odirect_fallback": bool(st["odirect_fallback"]),
            "bytes": nbytes, "seconds": round(seconds, 6), "bytes_per_s": nbytes / seconds,
            "disk_read_bytes": disk_read_bytes() - io0, "resident_before": round(cold, 4)}


def measure(path: str | os.PathLike[str], size: int = DEFAULT_SIZE, workers: Sequence[int] = WORKERS,
            chunks: Sequence[int] = CHUNKS, log: Log | None = None) -> dict[str, Any]:
    """Measure the disk holding `path` on a temporary `size`-byte file beside it (deleted after); see the module."""
    log = log or (lambda s: None)
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    if not folder.exists():
        raise BenchError(f"--disk {path}: no such file or folder")
    size = max(size, 2 * max(chunks), SEQ_READ)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".sluice-disk-", suffix=".tmp")
    os.close(fd)
    results: list[dict[str, Any]] = []
    try:
        log(f"writing {format_bytes(size)} of random bytes to {tmp}")
        _write_random(tmp, size)
        rng = np.random.default_rng(1)
        for odirect in (False, True):
            seq = [(off, min(SEQ_READ, size - off)) for off in range(0, size, SEQ_READ)]
            results.append({"pattern": "sequential", "chunk": SEQ_READ,
                            **_timed_read(tmp, seq, 1, odirect, 8 * SEQ_READ)})
            log(describe(results[-1]))
            for chunk in chunks:
                # every other chunk-sized slot, in random order: reads never touch, so none are merged
                slots = rng.permutation(size // (2 * chunk))[: max(1, RANDOM_BYTES // chunk)]
                ranges = [(int(s) * 2 * chunk, chunk) for s in slots]
                for w in workers:
                    results.append({"pattern": "random", "chunk": chunk,
                                    **_timed_read(tmp, ranges, w, odirect, BATCH_BYTES)})
                    log(describe(results[-1]))
    finally:
        os.unlink(tmp)
    dev = device_of(folder)
    out: dict[str, Any] = {
        "device": dev,
        "major_minor": f"{os.major(dev)}:{os.minor(dev)}",
        "path": str(folder.resolve()),
        "file_bytes": size,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "cold_verified": all(e["resident_before"] <= 0.01 for e in results),
        "results": results,
    }
    out["best"] = best(out)
    out["best_bytes_per_s"] = out["best"]["bytes_per_s"]
    return out


def table(result: dict[str, Any]) -> str:
    """Markdown table of a measurement: one row per pattern and chunk size, one column per worker count."""
    workers = sorted({e["workers"] for e in result["results"] if e["pattern"] == "random"})
    lines = [f"disk {result['major_minor']} ({result['path']}), {format_bytes(result['file_bytes'])} file, "
             f"GB/s by workers; best: {describe(result['best'])}", "",
             "| pattern | mode | " + " | ".join(f"{w} w" for w in workers) + " |",
             "|---|---|" + "---|" * len(workers)]
    rows: dict[tuple[str, bool], dict[int, float]] = {}
    for e in result["results"]:
        kind = "sequential 8 MiB" if e["pattern"] == "sequential" else f"random {format_bytes(e['chunk'])}"
        rows.setdefault((kind, e["odirect"]), {})[e["workers"]] = e["bytes_per_s"] / 1e9
    for (kind, od), vals in rows.items():
        mode = "O_DIRECT" if od else "buffered"
        lines.append(f"| {kind} | {mode} | " + " | ".join(f"{vals[w]:.2f}" if w in vals else "" for w in workers)
                     + " |")
    return "\n".join(lines)
