"""Typed options with one documented default each. Unknown names are errors; sizes accept "4GiB" / "512MB"."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

import torch

from .errors import ConfigError

IO_MODES = ("mmap", "willneed", "direct")
EMBEDDING_MODES = ("resident", "mmap", "direct")
PREFETCH_MODES = ("none", "router", "learned")
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16", "f16": "float16"}

# Direct-read threads: each is a read in flight. The disk saturates at ~8 (io/direct.py's table: 8 and 16 are within
# noise of each other), and each thread holds a staging buffer of up to 8 MiB: 64 leaves room for deeper NVMe
# queues while 10^5 threads (a traceback) or 10^9 (an OOM kill) cannot be asked for.
MAX_IO_WORKERS = 64
# Compute threads: more than the machine's logical CPUs only makes them wait on each other (and 100,000 of them
# crashed torch under a task limit).
MAX_THREADS = os.cpu_count() or 1

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: int | str, field: str = "memory") -> int:
    """Bytes from an int or a string like "4GiB", "512MB", "1.5 GiB", "1073741824"."""
    if isinstance(value, bool):
        raise ConfigError(f"{field}: expected a size like 4GiB or 512MB, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"{field}: expected a size like 4GiB, 512MiB, 2GB or a byte count, got {value!r}")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ConfigError(f"{field}: size must be positive, got {value!r}")
    return n


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, as budgets are given)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@dataclass
class LoadOptions:
    """How a model is loaded and run.

    memory:        budget in bytes for resident weights + expert slots; None (or "all") = everything resident, no
                   streaming; "auto" = resident when the model fits in the memory this process may still take
                   (MemAvailable and any memory cgroup limit), else stream with that room, less the KV cache and a
                   runtime reserve, as the budget (store/budget.py auto_memory).
    io:            how expert bytes move: "mmap" (demand faults), "willneed" (mmap + MADV_WILLNEED hints),
                   "direct" (pread by a worker pool into owned buffers). Also used for the resident load.
    io_workers:    threads of the direct reader; 0 = the measured default of the reader; at most MAX_IO_WORKERS (64).
    odirect:       open files with O_DIRECT (direct mode), so streamed bytes do not also fill the page cache. None
                   (default) = auto: O_DIRECT when streaming and the experts cannot fit in the memory left beside the
                   budget either (then page cache only adds a copy and constant reclaim: buffered reads measured
                   1.3-1.6x slower in every benchmark under a ceiling), buffered otherwise (a roomy box keeps the
                   model in page cache after the first pass). True / False force it.
    dtype:         compute dtype: "auto" (the checkpoint's: float32 stays float32, bf16 stays bf16 -- on this class
                   of CPU bf16 GEMV runs ~1.8x faster than float32, measured 2.8 vs 5.2 ms for 8 experts of
                   2048x1536), or "float32" / "bfloat16" / "float16".
    max_context:   KV cache positions allocated once at load (capped by the model's max_position_embeddings).
    prefill_chunk: prompt tokens per forward pass during prefill.
    threads:       torch intra-op threads; 0 = the CPUs this process may use (its affinity mask, capped by a cgroup CPU
                   quota: sysmem.usable_cpus); at most MAX_THREADS (os.cpu_count()).
    embeddings:    token embedding table: "resident", or rows read per batch ("mmap" | "direct") so the table
                   stays on disk (forced resident when the LM head is tied to it).
    prefetch:      "none", "router" or "learned": during decode, the hidden state after layer L's attention
                   predicts layer L+1's experts, read in the background (streaming stores only). "router" applies
                   layer L+1's router to it (training-free); "learned" applies heads fit by `sluice prerouter fit`,
                   read from prerouter.safetensors beside the model (a CheckpointError when missing or stale).
    prefetch_margin: experts predicted beyond top_k per token.
    overlap:       streaming: run the experts already in memory while the others are read, each as soon as its
                   bytes land (False: wait for all of a layer's reads first). Same output either way.
    """

    memory: int | str | None = "auto"
    io: str = "direct"
    io_workers: int = 0
    odirect: bool | None = None
    dtype: str = "auto"
    max_context: int = 4096
    prefill_chunk: int = 256
    threads: int = 0
    embeddings: str = "resident"
    prefetch: str = "none"
    prefetch_margin: int = 0
    overlap: bool = True

    def __post_init__(self):
        if isinstance(self.memory, str) and self.memory.strip().lower() in ("auto", "all"):
            self.memory = None if self.memory.strip().lower() == "all" else "auto"
        elif self.memory is not None:
            try:
                self.memory = parse_size(self.memory)
            except ConfigError:
                raise ConfigError(f"memory: expected auto, all, or a size like 4GiB / 512MB / a byte count, got "
                                  f"{self.memory!r}") from None
        if self.io not in IO_MODES:
            raise ConfigError(f"io: {self.io!r} is not one of {', '.join(IO_MODES)}")
        if self.embeddings not in EMBEDDING_MODES:
            raise ConfigError(f"embeddings: {self.embeddings!r} is not one of {', '.join(EMBEDDING_MODES)}")
        self.dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype != "auto" and self.dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"dtype: {self.dtype!r} is not one of auto, {', '.join(COMPUTE_DTYPES)}")
        for name in ("max_context", "prefill_chunk"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        if self.prefetch not in PREFETCH_MODES:
            raise ConfigError(f"prefetch: {self.prefetch!r} is not one of {', '.join(PREFETCH_MODES)}")
        if not _is_int(self.prefetch_margin) or self.prefetch_margin < 0:
            raise ConfigError(f"prefetch_margin: must be an integer >= 0, got {self.prefetch_margin!r}")
        for name, most, why in (("io_workers", MAX_IO_WORKERS, "the disk saturates at ~8 reads in flight"),
                                ("threads", MAX_THREADS, "this machine's logical CPUs")):
            value = getattr(self, name)
            if not _is_int(value) or not 0 <= value <= most:
                raise ConfigError(f"{name}: must be an integer from 0 (the default) to {most} ({why}), got {value!r}")

    @classmethod
    def make(cls, **kwargs) -> "LoadOptions":
        """Build from keyword arguments; an unknown name is a ConfigError listing the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)

    def compute_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """The dtype the math runs in."""
        if self.dtype != "auto":
            return COMPUTE_DTYPES[self.dtype]
        return checkpoint_dtype if checkpoint_dtype in COMPUTE_DTYPES.values() else torch.float32
