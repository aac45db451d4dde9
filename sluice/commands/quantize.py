"""`sluice quantize SRC OUT --to TYPE`: a Hugging Face MoE folder (qwen3_moe, qwen2_moe, olmoe, mixtral; glm4_moe to
MLX only) as a smaller checkpoint: a GGUF file of one type that sluice and llama.cpp run, an mlx-community-style
MLX folder (mlx-4bit, mlx-8bit) that mlx-lm runs, or an FP8 folder as the hub's DeepSeek-V3 / Qwen3 FP8 uploads are
(fp8; any gate / up / down MoE family, deepseek_v3 included) that transformers runs (see sluice/tools/quantize.py).

K-quants (Q2_K, Q3_K_M, Q4_K_M, ...) and the IQ types: `sluice quantize SRC model-bf16.gguf --to bf16`, then
llama.cpp's `llama-quantize model-bf16.gguf model-Q4_K_M.gguf Q4_K_M`; IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S and
IQ3_XXS need an importance matrix: `llama-imatrix -m model-bf16.gguf -f calibration.txt`, then
`llama-quantize --imatrix imatrix.gguf ...` (benchmarks/quality.py imatrix / quantize --imatrix do the same from
Python).
"""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import OutputError, SluiceError
from ..units import format_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..tools.quantize import TYPES

    p.add_argument("src", metavar="SRC", help="Hugging Face model folder (config.json + safetensors + tokenizer.json)")
    p.add_argument("out", metavar="OUT", help="GGUF file, or for mlx-* and fp8: a folder, to write (written as "
                                              "OUT.partial, then renamed)")
    p.add_argument("--to", required=True, metavar="TYPE",
                   help=f"one of {', '.join(TYPES)}: norms and routers stay F32 and rows that are not whole blocks "
                        "fall back to F16, as llama.cpp's tools do; tq1_0 / tq2_0 (ternary, 256-blocks): embeddings "
                        "and output F16, as convert_hf_to_gguf.py writes them; mxfp4: the routed experts MXFP4, "
                        "the rest Q8_0, as llama-quantize's MXFP4_MOE; K-quants (Q2_K, Q4_K_M, ...) and IQ types come "
                        "from llama.cpp's llama-quantize run on a bf16 file (IQ1_*, IQ2_XXS/XS/S, IQ3_XXS with an "
                        "importance matrix from llama-imatrix); mlx-4bit / mlx-8bit: affine groups of 64 as mlx_lm convert -q writes "
                        "them (needs the mlx package); fp8: e4m3 weights with 128 x 128 block scales "
                        "(weight_scale_inv) as DeepSeek-V3 and the Qwen3 FP8 uploads ship them")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--json", action="store_true", help="print one JSON summary object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    from ..tools.quantize import check_type, planned_bytes, quantize

    to = check_type(args.to)
    try:
        if not to.startswith(("mlx", "fp8")):
            import gguf  # noqa: F401
    except ImportError:
        raise SluiceError("quantize to GGUF needs the gguf package: pip install 'sluice[gguf]' (or pip install gguf)")
    from tqdm import tqdm

    total = planned_bytes(args.src, to)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"quantize {to}",
              disable=True if args.no_progress else None) as bar:
        try:
            summary = quantize(args.src, args.out, to, progress=bar.update, force=args.force)
        except OSError as e:  # quantize removes OUT.partial on any error
            raise OutputError(args.out, e, f"the partial output {args.out}.partial was removed") from e
    for line in summary["fallbacks"]:
        print(f"sluice quantize: note: {line} (as llama.cpp does)", file=sys.stderr)
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {summary['path']}: {summary['tensors']} tensors, {format_bytes(summary['bytes'])}, {to}")
    return 0
