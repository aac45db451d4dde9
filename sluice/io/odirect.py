"""O_DIRECT's alignment: which blocks a file's O_DIRECT reads take (probed once per file, `odirect_align`), and how a
read's window is cut into buffers so that destinations at the file's offset modulo that alignment are read into
directly (`direct_iovecs`). The direct reader (io/direct.py) and its C threads (io/preader.c) read this way."""

from __future__ import annotations

import errno
import mmap
import os

from sluice.io.ranges import Read, address

# O_DIRECT needs offset, length and buffer address aligned to the device's logical block size (512 on this VM's
# virtio disk, 4096 on many NVMe drives); each file's alignment is probed when it is opened (odirect_align), the
# smallest of DIO_ALIGNS its reads accept. Why the smallest: a read goes straight into its destination only when the
# destination's address agrees with the file offset modulo the alignment (else through staging and a copy), and the
# streaming store places its slots so (store/streaming.py). At 512 every expert of a GGUF tensor agrees with its
# neighbours (their sizes are whole 512-byte blocks, 210 x 512 for a Q6_K expert of the issue-30 model): 99.7% of
# that model's expert bytes land in place, against 49.5% at 4096, where a layer's gate, up and down tensors sit at
# different residues (benchmarks/results/hybrid/dio-align.txt).
DIO_ALIGNS = (512, 1024, 2048, 4096)
ALIGN = DIO_ALIGNS[-1]  # the largest: windows and scratch areas that must suit any file


def direct_iovecs(r: Read, start: int, window: int, stage: memoryview,
                  align: int = ALIGN) -> tuple[list[memoryview], list[tuple[int, int]]]:
    """O_DIRECT buffers for the window [start, start + window) of read `r` (start and window multiples of `align`,
    the file's O_DIRECT alignment; `stage` page-aligned), in file order, each `align`-aligned in address and length,
    and per segment the run [a, b) of its bytes read straight into its primary destination ((0, 0) when none).

    A segment's whole blocks go to its destination when the destination's address and the segment's file offset
    agree modulo `align` (the streaming store places its slots so: store/streaming.py); the rest of the window,
    partial blocks included, goes to the same place in `stage`. Overlapping segments all go through staging."""
    bufs: list[memoryview] = []
    direct: list[tuple[int, int]] = []
    pos = start
    for seg in r.segments:
        o = r.offset + seg.rel
        a, b = -(-o // align) * align, (o + seg.nbytes) // align * align
        dst = seg.dests[0]
        if r.overlapping or b <= a or a < pos or (address(dst) - o) % align:
            direct.append((0, 0))
            continue
        if a > pos:
            bufs.append(stage[pos - start : a - start])
        bufs.append(dst[a - o : b - o])
        direct.append((a - o, b - o))
        pos = b
    if pos < start + window:
        bufs.append(stage[pos - start : window])
    return bufs, direct


_PROBE = memoryview(mmap.mmap(-1, 2 * ALIGN))


def odirect_align(fd: int) -> int:
    """The smallest of DIO_ALIGNS that O_DIRECT reads of this file accept (offset, length and address aligned to it
    and to no more), or 0 when none does: some filesystems accept O_DIRECT at open but fail each read with EINVAL."""
    size = os.fstat(fd).st_size
    for a in DIO_ALIGNS:
        # at a file offset and an address that are a-aligned and not 2a-aligned; a read past the end proves nothing
        # (it returns 0 before any check), so a file shorter than 2a blocks is read as the largest alignment's
        at = a if 2 * a <= size else 0 if a == ALIGN else None
        if at is None:
            continue
        try:
            os.preadv(fd, [_PROBE[at : at + a]], at)
        except OSError as e:
            if e.errno == errno.EINVAL:
                continue
            raise
        return a
    return 0
