"""`sluice demo`: inflate the trained demo model once into the user cache folder, quantize it once to a 4-bit GGUF
(Q4_0, as a user would download it), then stream that file's experts under a memory budget smaller than it and print
the generated text and a stats line.

The demo model (sluice/assets/demo, see TRAINING.md there) is a small qwen3_moe trained on Python's documentation.
Inflating pads every expert with zeros (sluice/inflate.py): the text is exactly what the small model writes, while
each expert weighs N times more, so the run streams experts from disk with a trained model's routing.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

from ..engine import load
from ..options import LoadOptions, add_load_arguments, format_bytes, options_from_args, parse_size
from ..plan import plan
from .common import stats_line
from ..plan import open_index

DEFAULT_MEMORY = 384 * 2**20


def cache_dir() -> Path:
    """$SLUICE_CACHE, else $XDG_CACHE_HOME/sluice, else ~/.cache/sluice."""
    if os.environ.get("SLUICE_CACHE"):
        return Path(os.environ["SLUICE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "sluice"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="1GiB",
                   help="size of the inflated demo model (default 1GiB; the smallest expert scale reaching it)")
    # no --memory: a budget chosen so that the demo streams
    add_load_arguments(p, only=("memory", "io"), defaults={"memory": None}, helps={
        "memory": "budget for resident weights + expert cache, as `sluice run` takes it (default 384MiB, or the "
                  "resident weights and half the experts if smaller, so it streams)"})
    p.add_argument("--quant", default="q4_0", choices=("q4_0", "q8_0", "none"),
                   help="the inflated model quantized once with `sluice quantize` (default q4_0: 4-bit, the bytes "
                        "users download); none: run the bf16 folder")
    p.add_argument("--prompt", default="When you")
    p.add_argument("--max-tokens", type=int, default=48)
    # Greedy decoding of a model this small loops on one sentence ("The module defines the following functions:");
    # a mild penalty keeps it deterministic and reads better. 1.0 = plain greedy.
    p.add_argument("--repetition-penalty", type=float, default=1.3, help="greedy with this penalty (default 1.3)")


def ensure_demo_model(size: int) -> Path:
    """The shipped demo model inflated to at least `size` bytes, created on first use (with a progress bar).

    The folder name carries the expert scale and a digest of the shipped weights, so a new sluice release with a
    retrained model inflates again instead of reusing a stale copy.
    """
    from ..tools.inflate import demo_model_dir, inflate, scale_for_size

    src = demo_model_dir()
    index = open_index(src)
    scale = scale_for_size(index, size)
    digest = hashlib.sha256()
    for f in index.files:
        digest.update(f.read_bytes())
    out = cache_dir() / f"demo-x{scale}-{digest.hexdigest()[:12]}"
    if not (out / "config.json").exists():
        print(f"inflating the demo model x{scale} into {out} (once)", file=sys.stderr)
        inflate(src, out, scale, progress=True, force=True)
    return out


def ensure_quantized(folder: Path, to: str) -> Path:
    """`folder` quantized to `to` as a GGUF beside it, written on first use (with a progress bar)."""
    from tqdm import tqdm

    from ..tools.quantize import planned_bytes, quantize

    out = folder.parent / f"{folder.name}-{to}.gguf"
    if not out.exists():
        print(f"quantizing it to {to.upper()} into {out} (once)", file=sys.stderr)
        with tqdm(total=planned_bytes(folder, to), unit="B", unit_scale=True, desc="quantize") as bar:
            quantize(folder, out, to, progress=bar.update, force=True)
    return out


def main(args: argparse.Namespace) -> int:
    size = parse_size(args.size, "--size")
    given = options_from_args(args)  # --memory, --io checked before the model is inflated
    model = ensure_demo_model(size)
    if args.quant != "none":
        model = ensure_quantized(model, args.quant)
    files = [model] if model.is_file() else list(model.glob("*.safetensors"))
    model_bytes = sum(f.stat().st_size for f in files)
    if args.memory:
        memory = given.memory
    else:  # the resident weights and half the experts, so it streams
        p = plan(model, LoadOptions.make(memory="all", io=given.io))
        memory = min(DEFAULT_MEMORY, p.resident_bytes + p.layout.expert_nbytes * p.layout.total_experts // 2)
    shown = format_bytes(memory) if isinstance(memory, int) else memory or "all"
    print(f"model {model.name}: {format_bytes(model_bytes)} on disk, running with --memory {shown} --io {given.io}",
          file=sys.stderr)
    with load(model, memory=memory, io=given.io, progress=True) as m:
        print(args.prompt, end="", flush=True)
        for piece in m.generate(args.prompt, max_tokens=args.max_tokens,
                                repetition_penalty=args.repetition_penalty):
            print(piece, end="", flush=True)
        print()
        st = m.stats()
        print(stats_line(st), file=sys.stderr)
        print(f"expert cache {st['slots']} slots = {format_bytes(st['slot_bytes'])}, resident "
              f"{format_bytes(st['resident_bytes'])}, KV cache {format_bytes(st['kv_cache_bytes'])}", file=sys.stderr)
    return 0
