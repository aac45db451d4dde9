"""`sluice demo`: build the demo model in the user cache folder once, then stream it under a memory budget smaller
than the model and print the text and a stats line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..engine import load
from ..options import format_bytes, parse_size
from .common import stats_line


def cache_dir() -> Path:
    """$SLUICE_CACHE, else $XDG_CACHE_HOME/sluice, else ~/.cache/sluice."""
    if os.environ.get("SLUICE_CACHE"):
        return Path(os.environ["SLUICE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "sluice"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="384MiB", help="demo model size (default 384MiB)")
    p.add_argument("--memory", default=None,
                   help="budget for resident weights + expert cache (default: half the model, so it streams)")
    p.add_argument("--io", default="direct", choices=["mmap", "willneed", "direct"])
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--max-tokens", type=int, default=32)


def ensure_demo_model(size: int) -> Path:
    """The synthetic demo checkpoint for `size`, created on first use (with a progress bar)."""
    from ..synth import config_for_size, make_model

    out = cache_dir() / f"demo-qwen3_moe-{size // 2**20}MiB"
    if not (out / "config.json").exists():
        print(f"creating the demo model in {out} (once)", file=sys.stderr)
        make_model(out, config_for_size("qwen3_moe", size), progress=True)
    return out


def main(args: argparse.Namespace) -> int:
    size = parse_size(args.size, "--size")
    folder = ensure_demo_model(size)
    model_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    memory = parse_size(args.memory) if args.memory else model_bytes // 2
    print(f"model {folder.name}: {format_bytes(model_bytes)} on disk, running with --memory {format_bytes(memory)}"
          f" --io {args.io}", file=sys.stderr)
    with load(folder, memory=memory, io=args.io, progress=True) as m:
        print(args.prompt, end="", flush=True)
        for piece in m.generate(args.prompt, max_tokens=args.max_tokens):
            print(piece, end="", flush=True)
        print()
        st = m.stats()
        print(stats_line(st), file=sys.stderr)
        print(f"expert cache {st['slots']} slots = {format_bytes(st['slot_bytes'])}, resident "
              f"{format_bytes(st['resident_bytes'])}, KV cache {format_bytes(st['kv_cache_bytes'])}", file=sys.stderr)
    return 0
