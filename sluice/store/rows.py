"""RowTable: rows of a large 2-D table (token embeddings, per-layer embedding tables) fetched by id.

    table = RowTable(index["model.embed_tokens.weight"], "direct", reader=pool, dtype=torch.float32)
    x = table.gather(token_ids)   # [n, cols], bitwise equal to full_table[token_ids].to(dtype)

A table may be stored in a ggml block format (a GGUF's quantized n-gram table: Q8_0, Q4_K, ...; any format
quant/ggml.py dequantizes): a row is then its whole blocks (TensorRef.row_nbytes bytes), read, deduped and staged as
raw bytes like a plain row, and the distinct rows of a batch are dequantized together (float32, bitwise the gguf
reference) before duplicates are copied. "resident" keeps such a table in its blocks, not dequantized (a Q4 table
would grow 8x), and dequantizes the rows a batch needs from them: every mode dequantizes the same bytes of the same
distinct rows, so the modes stay bitwise equal.

One logical table may be stored in parts (the hub splits qwen4_exp's n-gram tables into hundreds of
`...shard_K.weight` tensors): given a list of refs, the table is their rows stacked in that order, and a row id is
read from the part that holds it. Nothing concatenates the parts: streamed modes read each row from its part's bytes,
"resident" keeps each part as it was read.

Modes:
- "resident": the whole table is read once (read_tensor) and rows are indexed out of memory.
- "mmap": rows are copied out of a read-only mapping by a mapping reader (MmapReader, or WillneedReader which hints
  first). Page faults happen during that copy, in the caller's thread, as for any mmap user.
- "direct": rows are read by the reader's worker pool (DirectReader, buffered or O_DIRECT) with os.preadv.

In every mode a batch is deduped and sorted first (the counters say how many distinct rows a batch needed). In
"mmap" and "direct" each distinct row becomes one ReadRange into one row of a staging buffer (the reader sorts and
coalesces adjacent rows into one file read, so neighbouring ids cost one syscall, not one per row), and the
requested order, duplicates included, is rebuilt from staging with one index_select. Both modes share this code
path, so "streamed == resident" is one property, tested once.

Why "mmap" goes through the reader rather than a numpy memmap over the table's region: the reader's mapping is
the one the expert store already uses (no second mapping of a multi-GiB file), its stats count the faults of the
copy, its per-batch check turns a file truncated or rewritten since load into a CheckpointError naming the file
instead of a SIGBUS or wrong rows (a truncation during the copy itself still faults: io/mapped.py), and "mmap" vs
"direct" then compares the I/O, not two gather implementations. The cost is Python per distinct row (ReadRange, plan,
scatter). Measured here (2-core VM, warm page cache, 4096 random ids = ~3850 distinct rows, noisy +-50%):
1 KiB rows ~6 us/row through the MmapReader vs ~0.2 us/row for `np.take` over a memmap; 8 KiB rows ~24 vs ~3
us/row; one id ~0.1-0.4 ms. So a 4096-token prefill chunk spends 20-90 ms here on its embedding rows (not yet
weighed against that chunk's forward pass).
TODO: if a profile ever shows it, gather "mmap" rows with np.take over the reader's mapping instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from sluice.checkpoint.ref import TensorRef
from sluice.errors import CheckpointError
from sluice.io import DirectReader, MmapReader, ReadRange, Reader
from sluice.io.tensor import read_bytes
from sluice.quant import ggml
from sluice.quant.tensor import read_tensor

MODES = ("resident", "mmap", "direct")
# Which reader modes may serve each streamed RowTable mode: a direct pool handed to an "mmap" table (or the other
# way round) is a wiring mistake that would silently measure the wrong thing.
_READER_MODES = {"mmap": ("mmap", "willneed"), "direct": ("direct",)}
# Staging starts with room for this many rows (one decode step needs 1, a prefill chunk up to a few thousand) and
# doubles when a batch needs more; it never exceeds the table.
DEFAULT_STAGING_ROWS = 64


class RowTable:
    """Row gathers from one [rows, cols] tensor of a checkpoint (or several stacked along rows), in any dtype,
    resident or streamed.

    `ref`: where the table's bytes are (must be 2-D), or a list of parts of the same columns and dtype whose rows
    stack in list order; a plain dtype or a ggml block format (rows of whole blocks, gathered as float32). `mode`:
    one of MODES. `reader`: the reader that moves the bytes in "mmap" (a mapping reader) and "direct" (a
    DirectReader) modes; when None, the table makes its own (MmapReader / DirectReader with
    default workers) and closes it in close(). Ignored by "resident". `dtype`: dtype of gather()'s output
    (conversion after gathering; None keeps the table's dtype). `staging_rows`: initial staging capacity in rows for
    the streamed modes (grown on demand). `name`: what errors and stats call the table (default: its first part's).

    gather() is serialized by a lock: the staging buffer is shared by all calls.
    """

    def __init__(
        self,
        ref: TensorRef | Sequence[TensorRef],
        mode: str,
        reader: Reader | None = None,
        dtype: torch.dtype | None = None,
        *,
        staging_rows: int = DEFAULT_STAGING_ROWS,
        name: str | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"unknown RowTable mode {mode!r}; choose one of {', '.join(MODES)}")
        parts = [ref] if isinstance(ref, TensorRef) else list(ref)
        if not parts:
            raise ValueError(f"RowTable {name!r}: no parts")
        for part in parts:
            _check_part(part, parts[0])
        if staging_rows < 1:
            raise ValueError(f"staging_rows must be >= 1, got {staging_rows}")
        self.ref, self.parts = parts[0], parts
        self._name = name or parts[0].name
        self.mode = mode
        self.starts = [0]  # each part's first row in the table, then the table's rows
        for part in parts:
            self.starts.append(self.starts[-1] + part.shape[0])
        self._starts = torch.tensor(self.starts)  # [parts + 1] int64
        self.rows, self.cols = self.starts[-1], self.ref.shape[1]
        self.row_bytes = self.ref.row_nbytes  # elements x itemsize, or whole blocks
        # a block format's rows are dequantized to float32 after the read (self.blocks: its name, else None)
        self.blocks = self.ref.dtype if self.ref.quantized else None
        self.table_dtype = torch.float32 if self.blocks else self.ref.torch_dtype
        self.dtype = dtype if dtype is not None else self.table_dtype
        self._lock = threading.Lock()
        self._rows_requested = 0
        self._rows_distinct = 0
        self._rows_read = 0
        self._bytes_read = 0
        self._wait_s = 0.0
        self._gathers = 0

        # each part [rows, cols] in the table's dtype, or its blocks [rows, row_bytes] uint8; "resident" only
        self._tables: list[torch.Tensor] = []
        self._reader: Reader | None = None
        self._own_reader = False
        self._capacity = 0  # rows staging holds
        self._staging = torch.empty(0, dtype=torch.uint8)  # [capacity, row_bytes], streamed modes only
        # Flat byte view of _staging; per-row destinations are slices of it: plan_reads takes a memoryview slice in
        # ~0.7 us, a uint8 tensor row in ~4.6 us (it has to go through .numpy()), measured on this VM.
        self._staging_mv = memoryview(b"")
        if mode == "resident":
            # The stored dtype (or blocks) is kept (not `dtype`): converting gathered rows costs little per call,
            # converting the table could double its memory (bf16 -> float32), dequantizing it much more.
            self._tables = [read_bytes(part).view(part.shape[0], self.row_bytes) if self.blocks else read_tensor(part)
                            for part in parts]  # [rows_i, cols] or [rows_i, row_bytes] each
            self._rows_read = self.rows
            self._bytes_read = sum(part.nbytes for part in parts)
            return
        if reader is None:
            reader = MmapReader() if mode == "mmap" else DirectReader()
            self._own_reader = True
        elif getattr(reader, "mode", None) not in _READER_MODES[mode]:
            raise ValueError(
                f"RowTable {self.name!r} in mode {mode!r} needs a reader of mode "
                f"{' or '.join(map(repr, _READER_MODES[mode]))}, got {getattr(reader, 'mode', type(reader).__name__)!r}"
            )
        # the table's files are read only as the versions their headers described
        reader.expect([part.stamp for part in parts if part.stamp is not None])
        self._reader = reader
        self._grow(min(staging_rows, self.rows))

    # -- public --------------------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def reader(self) -> Reader | None:
        """The reader that moves this table's rows (shared with the model's, or its own); None when resident."""
        return self._reader

    @property
    def nbytes_resident(self) -> int:
        """Bytes this table holds in memory: the whole table ("resident") or the staging buffer (streamed)."""
        if self.mode == "resident":
            return sum(part.nbytes for part in self.parts) if self._tables else 0
        return self._staging.numel()

    def gather(self, ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Rows `ids` of the table as a new tensor [*ids.shape, cols] (1-D ids: [n, cols]) in `self.dtype`.

        Bitwise equal to `full_table[ids].to(dtype)` (a block format: its float32 dequantization's rows, as the
        gguf package computes them). Each distinct id is read once per call; duplicates are
        copied. IndexError (naming the table and the id) for an id outside [0, rows), negative ids included;
        TypeError for non-integer ids.
        """
        flat, shape = self._check_ids(ids)  # [n] int64
        with self._lock:
            if self.mode != "resident" and self._reader is None or self.mode == "resident" and not self._tables:
                raise RuntimeError(f"RowTable {self.name!r} is closed")
            self._gathers += 1
            self._rows_requested += flat.numel()
            uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)  # [k] ascending, [n] into uniq
            self._rows_distinct += uniq.numel()
            stored = self._resident_rows(uniq) if self.mode == "resident" else self._read_rows(uniq)
            rows = self._values(stored)  # [k, cols]
            out = rows.index_select(0, inverse)  # [n, cols], new memory: staging is reused by the next call
        return out.to(self.dtype).reshape(*shape, self.cols)

    def stats(self) -> dict[str, Any]:
        """Counters since the table was made.

        rows_requested: ids asked for, duplicates included. rows_distinct: the distinct ids of each gather, summed
        (what the gathers needed, in every mode). rows_read / bytes_read: distinct rows (and their bytes) requested
        from the file; "resident" counts its one load of the whole table. The reader's own stats add gaps read
        through while coalescing. wait_s: time gathers spent blocked on reads. nbytes_resident: see the property.
        """
        with self._lock:
            return {
                "name": self.name,
                "mode": self.mode,
                "gathers": self._gathers,
                "rows_requested": self._rows_requested,
                "rows_distinct": self._rows_distinct,
                "rows_read": self._rows_read,
                "bytes_read": self._bytes_read,
                "wait_s": self._wait_s,
                "nbytes_resident": self.nbytes_resident,
            }

    def close(self) -> None:
        """Drop the table / staging; close the reader if this table made it. Idempotent."""
        with self._lock:
            self._tables = []
            self._staging_mv.release()
            self._staging_mv = memoryview(b"")
            self._staging = torch.empty(0, dtype=torch.uint8)
            self._capacity = 0
            if self._own_reader and self._reader is not None:
                self._reader.close()
            self._reader = None

    def __enter__(self) -> RowTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        parts = f", {len(self.parts)} parts" if len(self.parts) > 1 else ""
        return f"RowTable({self.name!r}, [{self.rows}, {self.cols}] {self.ref.dtype}{parts}, mode={self.mode!r})"

    # -- internals -----------------------------------------------------------------------------------------------
    def _check_ids(self, ids: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, tuple[int, ...]]:
        """ids as a flat int64 CPU tensor [n] plus their shape; IndexError naming the table and the first bad id."""
        if not isinstance(ids, torch.Tensor):
            ids = torch.as_tensor(list(ids), dtype=torch.int64) if len(ids) else torch.empty(0, dtype=torch.int64)
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"row ids for {self.name!r} must be integers, got {ids.dtype}")
        shape = tuple(ids.shape)
        flat = ids.reshape(-1).to(device="cpu", dtype=torch.int64)  # [n]
        if flat.numel():
            bad = (flat < 0) | (flat >= self.rows)  # [n]
            if bool(bad.any()):
                first = int(flat[bad.nonzero()[0, 0]])
                where = self.ref.path if len(self.parts) == 1 else f"{len(self.parts)} parts"
                raise IndexError(
                    f"row table {self.name!r} [{self.rows}, {self.cols}] ({where}): id {first} is out of "
                    f"range [0, {self.rows})"
                )
        return flat, shape

    def _grow(self, n: int) -> None:
        """Make staging hold at least `n` rows: double (capped at the table) so a run of growing batches
        reallocates O(log rows) times, never per call."""
        if n <= self._capacity:
            return
        self._capacity = min(max(n, 2 * self._capacity), self.rows)
        self._staging_mv.release()
        self._staging = torch.empty(self._capacity, self.row_bytes, dtype=torch.uint8)  # [capacity, row_bytes]
        # an empty table or zero-width rows read nothing: numpy cannot cast a view with a zero in its shape
        self._staging_mv = memoryview(self._staging.numpy()).cast("B") if self._staging.numel() else memoryview(b"")

    def _values(self, stored: torch.Tensor) -> torch.Tensor:
        """The distinct rows as stored (a plain dtype [k, cols], or blocks [k, row_bytes] uint8) -> their values
        [k, cols]: blocks dequantized to float32 (a new tensor, so staging is free again)."""
        if self.blocks is None:
            return stored
        return ggml.dequantize(stored, self.blocks, shape=(stored.shape[0], self.cols))  # _check_part: it can

    def _resident_rows(self, uniq: torch.Tensor) -> torch.Tensor:
        """Rows `uniq` [k] (ascending) of the resident parts -> [k, cols] (blocks: [k, row_bytes])."""
        if len(self._tables) == 1:
            return self._tables[0].index_select(0, uniq)
        first = self._tables[0]
        out = torch.empty(uniq.numel(), first.shape[1], dtype=first.dtype)
        cut = torch.searchsorted(uniq, self._starts).tolist()  # uniq[cut[i]:cut[i+1]] in part i
        for i, table in enumerate(self._tables):
            a, b = cut[i], cut[i + 1]
            if b > a:
                torch.index_select(table, 0, uniq[a:b] - self.starts[i], out=out[a:b])
        return out

    def _read_rows(self, uniq: torch.Tensor) -> torch.Tensor:
        """Read each row of `uniq` [k] (ascending, distinct) once into staging -> a view of staging: [k, cols] of
        the table's dtype, or the blocks [k, row_bytes] uint8."""
        k = uniq.numel()
        if not k or not self.row_bytes:  # nothing to read (zero-width rows: a [k, 0] result)
            return torch.empty(k, self.cols, dtype=self.table_dtype) if self.blocks is None else \
                torch.empty(k, self.row_bytes, dtype=torch.uint8)
        self._grow(k)
        rb, mv, parts = self.row_bytes, self._staging_mv, self.parts
        # One request per distinct row, in file order (parts in order, rows ascending in each); the reader coalesces
        # runs of adjacent rows into single reads (and, for the direct pool, spreads the resulting reads over its
        # workers by bytes, not one task per row).
        if len(parts) == 1:
            path, base = parts[0].path, parts[0].offset
            requests = [(ReadRange(path, base + r * rb, rb), mv[i * rb : (i + 1) * rb])
                        for i, r in enumerate(uniq.tolist())]
        else:
            j = torch.searchsorted(self._starts, uniq, right=True) - 1  # [k] each row's part
            local = (uniq - self._starts[j]).tolist()
            requests = [(ReadRange(parts[p].path, parts[p].offset + r * rb, rb), mv[i * rb : (i + 1) * rb])
                        for i, (p, r) in enumerate(zip(j.tolist(), local))]
        t0 = time.perf_counter()
        self._reader.read(requests)
        self._wait_s += time.perf_counter() - t0
        self._rows_read += k
        self._bytes_read += k * rb
        staged = self._staging[:k]  # [k, row_bytes]
        return staged if self.blocks else staged.view(self.table_dtype)  # [k, cols], a view of staging


def _check_part(part: TensorRef, first: TensorRef) -> None:
    """CheckpointError naming the part unless it is a 2-D table of `first`'s columns and dtype: a plain dtype, or a
    ggml block format quant/ggml.py dequantizes with rows of whole blocks."""
    if len(part.shape) != 2:
        raise CheckpointError(
            f"a row table must be 2-D [rows, cols], got shape {list(part.shape)}", file=part.path, tensor=part.name
        )
    if part.quantized and (part.mlx is not None or part.dtype not in ggml.DEQUANTIZABLE):
        raise CheckpointError(f"a row table stored as {part.dtype} cannot be read by rows: sluice dequantizes "
                              f"{', '.join(sorted(ggml.DEQUANTIZABLE))}", file=part.path, tensor=part.name)
    try:
        want = part.shape[0] * part.row_nbytes
    except ValueError as e:  # a row that is not whole blocks
        raise CheckpointError(str(e), file=part.path, tensor=part.name) from None
    if part.nbytes != want:
        raise CheckpointError(
            f"nbytes {part.nbytes} != {want} for dtype {part.dtype} shape {list(part.shape)}",
            file=part.path,
            tensor=part.name,
        )
    if part.shape[1] != first.shape[1] or part.dtype != first.dtype:
        raise CheckpointError(
            f"a part of the row table of {first.name!r} must have its {first.shape[1]} columns of {first.dtype}, got "
            f"{part.shape[1]} of {part.dtype}", file=part.path, tensor=part.name,
        )
