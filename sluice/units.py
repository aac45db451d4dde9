"""Sizes as users write them ("4GiB", "512MB") and as sluice prints them: used at every level, so imports nothing of
sluice but its errors."""

from __future__ import annotations

import re

from .errors import ConfigError

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


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, as budgets are given)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
