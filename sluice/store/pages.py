"""Page-aligned rows for expert bytes: an anonymous private mapping in transparent huge pages where the kernel gives
them (MADV_HUGEPAGE: THP "madvise" mode, the common default), for the streaming store's slots and the resident
store's stacks alike."""

from __future__ import annotations

import mmap

import torch


def page_rows(rows: int, stride: int, what: str = "expert slots") -> torch.Tensor:
    """zeros uint8 [rows, stride] from a page boundary, in huge pages where the kernel gives them (`what`: the
    rows, for the error when the system has no memory to map).

    Why huge pages: with the slots read in place (streaming._page_shifts) they cut a peers bf16 2,048-token prompt's
    system CPU 0.24 -> 0.14 s (O_DIRECT pins 512x fewer pages) and the expert GEMMs' TLB misses: 0.92-0.94 of the
    staged 4 KiB slots' time on three files, where in place in 4 KiB pages was 0.98-1.04
    (benchmarks/results/prefill/slots.md). A decode step reads each expert from another MiB: a layer's 8 experts of
    the peers Q4_K_M shape (8 MB, cold, 2 threads) took 439-456 us in huge pages, 470-502 in 4 KiB ones
    (benchmarks/quantized/expert_layer.py, results/quantized/breakdown/expert-layer.txt)."""
    if rows * stride == 0:
        return torch.zeros((rows, stride), dtype=torch.uint8)
    try:
        buf = mmap.mmap(-1, rows * stride, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        raise MemoryError(f"cannot map {rows} x {stride} bytes for {what}: {e.strerror or e}") from e
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no THP in this kernel (or not Linux): 4 KiB pages, the same bytes
        pass
    t = torch.frombuffer(buf, dtype=torch.uint8).view(rows, stride)  # keeps buf alive
    t.fill_(0)  # first-touch faults at load, not inside timed steps
    return t
