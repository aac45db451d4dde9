"""`quantize(src, out, to)`: a supported Hugging Face MoE folder made small, as a GGUF file of one type, an MLX
affine folder (mlx-4bit, mlx-8bit: tools/mlx_export.py, the layout `mlx_lm convert -q` writes) or an FP8 folder
(fp8: tools/fp8_export.py, the layout of the hub's DeepSeek-V3 / Kimi K2 / Qwen3 FP8 uploads).

GGUF types (`to`): f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, tq1_0, tq2_0, mxfp4 (every type the `gguf`
package can encode), laid out as llama.cpp's convert_hf_to_gguf.py + llama-quantize would (tools/gguf_export.py for
the names and metadata, tools/gguf_types.py for which tensors keep F32 or take another type). K-quants (Q2_K,
Q3_K_M, Q4_K_M, ...) and the IQ types are made by llama.cpp's `llama-quantize` from this function's bf16 output (the
`gguf` package has no encoder for them); IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S and IQ3_XXS need an importance matrix
(llama-imatrix's, or benchmarks/quality.py imatrix).

Streaming: one tensor (at most one layer's expert stack) is in memory at a time; the output is written under
OUT.partial and renamed at the end, removed on any error.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .gguf_types import GGUF_TYPES
from .mlx_export import MLX_TYPES

FP8_TYPES = ("fp8",)  # e4m3 weights with 128 x 128 block scales (tools/fp8_export.py)
#: every `to` quantize() accepts
TYPES = (*GGUF_TYPES, *MLX_TYPES, *FP8_TYPES)


def check_type(to: str) -> str:
    """`to` lower-cased if it is a known type, else a ConfigError listing them."""
    name = to.lower() if isinstance(to, str) else to
    if name not in TYPES:
        raise ConfigError(f"--to {to!r} is not a known type; choose one of {', '.join(TYPES)} (K-quants such as "
                          "Q4_K_M and the IQ types: quantize to bf16, then run llama.cpp's llama-quantize on that "
                          "file; IQ1_*, IQ2_XXS/XS/S and IQ3_XXS also need llama-imatrix's importance matrix)")
    return name


def planned_bytes(src: str | os.PathLike[str], to: str) -> int:
    """Bytes the output of quantize(src, ..., to) will hold (its tensor data: for a progress bar)."""
    to = check_type(to)
    if to in FP8_TYPES:
        from .fp8_export import planned_bytes as fp8_bytes

        return fp8_bytes(src)
    if to in MLX_TYPES:
        from .mlx_export import planned_bytes as mlx_bytes

        return mlx_bytes(src, MLX_TYPES[to])
    from .gguf_export import planned_bytes as gguf_bytes

    return gguf_bytes(src, to)


def quantize(src: str | os.PathLike[str], out: str | os.PathLike[str], to: str,
             progress: Callable[[int], None] | None = None, force: bool = False) -> dict[str, Any]:
    """Write the model folder `src` as `out` in type `to` (see TYPES); `force` replaces an existing OUT (a GGUF file,
    or an MLX / FP8 model folder).

    `progress(nbytes)` is called as output bytes are written. Returns a summary dict: path, bytes, type, tensors,
    and `fallbacks` (tensors whose rows are not whole blocks of the type, stored as F16, as llama.cpp does).
    ConfigError for an unknown type or config field, ExportError for a model llama.cpp's graph cannot run,
    OutputExistsError when OUT exists, OSError (disk full, ...) with nothing left behind.
    """
    to = check_type(to)
    if to in FP8_TYPES:
        from .fp8_export import export_fp8

        return export_fp8(Path(src), Path(out), force=force, progress=progress)
    if to in MLX_TYPES:
        from .mlx_export import export_mlx

        return export_mlx(Path(src), Path(out), MLX_TYPES[to], force=force, progress=progress)
    from .gguf_export import export_gguf

    summary = export_gguf(Path(src), Path(out), to, progress=progress, force=force)
    summary["type"] = to
    return summary
