"""How much of a streamed model's expert bytes an O_DIRECT read can move straight into the slots (no staging copy),
by alignment: under the store's per-layer shift (store/streaming.py _page_shifts) and under an ideal per-expert one,
for O_DIRECT alignments of 512 and 4096 bytes; then a short streamed decode's bytes copied out of staging.

    python benchmarks/results/hybrid/dio_align.py MODEL [--memory 640MiB]
"""

from __future__ import annotations

import argparse
import time

import sluice  # before torch
from sluice.engine import load
from sluice.store.streaming import _page_shifts


def whole_blocks(offset: int, nbytes: int, residue: int, align: int) -> int:
    """Bytes of [offset, offset + nbytes) in whole `align` blocks, when its destination sits at `residue`."""
    a, b = -(-offset // align) * align, (offset + nbytes) // align * align
    return max(0, b - a) if (offset - residue) % align == 0 else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--memory", default="640MiB")
    a = ap.parse_args()
    m = load(a.model, memory=a.memory, io="direct", odirect=True, prefetch="none")
    lay = m.layout
    files = sorted({p.range.path for L in lay.layers for p in lay.parts(L, 0)})
    align_of = getattr(m.reader, "alignment", lambda files: "4096 (before per-file alignments)")
    print(f"{sluice.__file__}\n{a.model}: slot {lay.slot_nbytes} bytes, formats {lay.format_names}; the files' O_DIRECT "
          f"alignment {align_of(files)}; the store's stride {m.store.raw.shape[1]}, {m.store.n_slots} slots, shifts "
          f"{sorted(set(m.store._shift.values()))}")
    for align in (4096, 512):
        try:
            shifts = _page_shifts(lay, align)
        except TypeError:  # a checkout from before per-file alignments: its shifts are modulo 4096 only
            continue
        total = by_layer = by_expert = 0
        for L in lay.layers:
            for e in range(lay.spec.num_experts):
                parts = lay.parts(L, e)
                votes: dict[int, int] = {}
                for p in parts:
                    r = (p.range.offset - p.dest_offset) % align
                    votes[r] = votes.get(r, 0) + p.range.nbytes
                best = max(votes, key=votes.__getitem__)
                for p in parts:
                    total += p.range.nbytes
                    by_layer += whole_blocks(p.range.offset, p.range.nbytes, shifts[L] + p.dest_offset, align)
                    by_expert += whole_blocks(p.range.offset, p.range.nbytes, best + p.dest_offset, align)
        print(f"align {align}: {total / 2**20:.1f} MiB of experts; in place with one shift a layer {by_layer / total:.1%}, "
              f"with one shift an expert {by_expert / total:.1%}")
    L = lay.layers[0]
    print(f"layer {L} expert 1: (projection, file offset % 4096, slot offset, bytes)",
          [(p.proj, p.range.offset % 4096, p.dest_offset, p.range.nbytes) for p in lay.parts(L, 1)])
    t = time.perf_counter()
    list(m.generate_tokens(list(range(100, 132)), max_tokens=8, stop_at_eos=False))
    st = m.reader.stats()
    print(f"32-token prompt + 8 tokens: {st['bytes_read'] / 2**20:.1f} MiB read, {st['copied_bytes'] / 2**20:.1f} MiB "
          f"copied out of staging, {time.perf_counter() - t:.2f} s")
    m.close()


if __name__ == "__main__":
    main()
