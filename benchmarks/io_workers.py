"""Measure read throughput per reader and worker count on a cold file; picks sluice.io.direct.DEFAULT_WORKERS.

    python benchmarks/io_workers.py [--size-gib 1.5] [--dir /var/tmp] [--rounds 3]

Writes a random file (deleted at the end), then for each arm, per round: evicts the file (verified cold by
mincore) and replays the same batches. Two workloads:
- experts: batches of 8 "experts" of 3 x 768 KiB + 3 x 48 KiB ranges at random unaligned offsets (~19.7 MB/batch,
  the shape of one Qwen3-30B-A3B 4-bit layer's misses);
- rows: batches of 256 random 4 KiB-ish (4000 B, unaligned) ranges, latency-bound (embedding rows).
Reports medians over rounds: MB/s, ms per batch, and read amplification (/proc/self/io read_bytes / bytes asked).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from sluice.io import DirectReader, MmapReader, ReadRange, WillneedReader  # noqa: E402
from sluice.io.residency import evict, verify_cold  # noqa: E402


def io_read_bytes() -> int:
    for line in open("/proc/self/io"):
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def make_file(path: str, size: int) -> None:
    rng = np.random.default_rng(0)
    chunk = 64 << 20
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(chunk, left)
            f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            left -= n


def expert_batches(path: str, size: int, n: int, seed: int) -> list[list[tuple[ReadRange, torch.Tensor]]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        reqs = []
        for _e in range(8):
            for nbytes in (768 << 10,) * 3 + (48 << 10,) * 3:
                off = int(rng.integers(0, size - nbytes))
                reqs.append((ReadRange(path, off, nbytes), torch.empty(nbytes, dtype=torch.uint8)))
        out.append(reqs)
    return out


def row_batches(path: str, size: int, n: int, seed: int) -> list[list[tuple[ReadRange, torch.Tensor]]]:
    rng = np.random.default_rng(seed + 1000)
    return [
        [
            (ReadRange(path, int(rng.integers(0, size - 4000)), 4000), torch.empty(4000, dtype=torch.uint8))
            for _ in range(256)
        ]
        for _ in range(n)
    ]


def run_arm(make, path: str, batches) -> tuple[float, float, float]:
    """(MB/s, median ms per batch, amplification) for one cold pass over `batches`."""
    evict(path)
    verify_cold([path])
    reader = make()
    asked = sum(r.nbytes for b in batches for r, _ in b)
    io0 = io_read_bytes()
    times = []
    t0 = time.perf_counter()
    for b in batches:
        t = time.perf_counter()
        reader.read(b)
        times.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    amp = (io_read_bytes() - io0) / asked
    reader.close()
    return asked / wall / 1e6, statistics.median(times) * 1e3, amp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.5)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--expert-batches", type=int, default=24)
    ap.add_argument("--row-batches", type=int, default=8)
    args = ap.parse_args()

    size = int(args.size_gib * (1 << 30))
    path = os.path.join(args.dir, f"sluice_io_workers_{os.getpid()}.bin")
    arms = {"mmap": MmapReader, "willneed": WillneedReader}
    for odirect in (False, True):
        for w in (1, 2, 4, 8, 16):
            arms[f"direct w={w}{' odirect' if odirect else ''}"] = lambda w=w, o=odirect: DirectReader(w, o)
    try:
        make_file(path, size)
        results: dict[str, list[tuple[float, float, float, float, float, float]]] = {k: [] for k in arms}
        names = list(arms)
        for rnd in range(args.rounds):
            eb = expert_batches(path, size, args.expert_batches, rnd)
            rb = row_batches(path, size, args.row_batches, rnd)
            order = names[rnd % len(names) :] + names[: rnd % len(names)]  # rotate so no arm always goes first
            for name in order:
                results[name].append(run_arm(arms[name], path, eb) + run_arm(arms[name], path, rb))
                print(f"round {rnd} {name}: {results[name][-1]}", file=sys.stderr)
        print(f"cold file {size / 2**30:.1f} GiB in {args.dir}, {args.rounds} rounds, medians")
        print("| arm | experts MB/s | ms/batch (19.7 MB) | amp | rows MB/s | ms/batch (256 x 4000 B) | amp |")
        print("|---|---|---|---|---|---|---|")
        for name in names:
            cols = [statistics.median(r[i] for r in results[name]) for i in range(6)]
            print(
                f"| {name} | {cols[0]:.0f} | {cols[1]:.1f} | {cols[2]:.2f} | {cols[3]:.1f} | {cols[4]:.1f} "
                f"| {cols[5]:.2f} |"
            )
    finally:
        if os.path.exists(path):
            os.unlink(path)


if __name__ == "__main__":
    main()
