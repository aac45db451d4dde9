"""`sluice export-gguf MODEL OUT.gguf [--dtype bf16|f32|f16]`: the same checkpoint as a GGUF file for llama.cpp.

Benchmarks run llama.cpp on exactly the weights and tokenizer sluice runs; see sluice/gguf_export.py for the tensor
mapping. Needs the optional `gguf` package (`pip install 'sluice[gguf]'`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import OutputError, SluiceError
from ..units import format_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="Hugging Face model folder (qwen3_moe, qwen2_moe, olmoe, mixtral)")
    p.add_argument("out", metavar="OUT.gguf", help="GGUF file to write (written as OUT.gguf.partial, then renamed)")
    p.add_argument("--dtype", choices=("bf16", "f32", "f16"), default="bf16",
                   help="dtype of the 2-D weights (default bf16: a bf16 checkpoint's exact bytes); norms and the "
                        "router stay f32; f32 makes llama.cpp compute in f32 throughout, at twice the bytes")
    p.add_argument("--force", action="store_true", help="replace OUT.gguf if it exists (a regular file only)")
    p.add_argument("--json", action="store_true", help="print one JSON summary object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    from ..tools.gguf_export import check_output

    check_output(Path(args.out), args.force)  # before any work
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise SluiceError("export-gguf needs the gguf package: pip install 'sluice[gguf]' (or pip install gguf)")
    from tqdm import tqdm

    from ..tools.gguf_export import export_gguf, planned_bytes

    total = planned_bytes(args.model, args.dtype)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="export-gguf",
              disable=True if args.no_progress else None) as bar:
        try:
            summary = export_gguf(args.model, args.out, args.dtype, progress=bar.update, force=args.force)
        except OSError as e:  # export_gguf removes OUT.partial on any error
            raise OutputError(args.out, e, f"the partial file {args.out}.partial was removed") from e
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {summary['path']}: {summary['tensors']} tensors, {format_bytes(summary['bytes'])}, "
              f"{summary['dtype']}, tokenizer {summary['tokenizer_pre']} ({summary['vocab']} tokens)")
    return 0
