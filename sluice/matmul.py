"""How several rows of bf16 activations multiply bf16 weights, process-wide (LoadOptions.matmul): torch's bf16 GEMM
where the CPU has bf16 dot-product instructions, float32 elsewhere. rows_linear serves plain weights (resident
projections, bf16 experts); the quantized kernels ask bf16_gemm() for their many-row path (quant/native/kernel.py,
quant/resident.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .host.cpus import bf16_dot

#: LoadOptions.matmul's choices: how several rows of bf16 activations multiply bf16 weights
MATMUL_MODES = ("auto", "bf16", "float32")
_bf16_gemm: bool | None = None  # set_matmul's answer; None until a load sets it (then "auto")


def set_matmul(mode: str) -> bool:
    """How rows_linear multiplies several bf16 rows, process-wide like the thread count (engine.py sets it at each
    load from LoadOptions.matmul): "bf16", torch's bf16 GEMM; "float32", both sides widened and a float32 GEMM;
    "auto", bf16 where the CPU has bf16 dot-product instructions (host/cpus.bf16_dot). Returns whether bf16 runs."""
    global _bf16_gemm
    if mode not in MATMUL_MODES:
        raise ValueError(f"matmul mode {mode!r}: expected one of {', '.join(MATMUL_MODES)}")
    _bf16_gemm = bf16_dot() if mode == "auto" else mode == "bf16"
    return _bf16_gemm


def describe_matmul(mode: str) -> str:
    """What `mode` (LoadOptions.matmul) means on this CPU, for `sluice inspect`."""
    if mode == "auto":
        return ("bf16 GEMM (auto: this CPU has bf16 dot-product instructions)" if bf16_dot()
                else "float32 GEMM (auto: this CPU has no bf16 dot-product instructions)")
    return f"{mode} GEMM (--matmul {mode})"


def bf16_gemm() -> bool:
    """Whether several bf16 rows run torch's bf16 GEMM (set_matmul; "auto" until a load set it)."""
    return set_matmul("auto") if _bf16_gemm is None else _bf16_gemm


def rows_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for x [n, in]; several rows of f16, and of bf16 unless bf16_gemm(), run in float32 and
    are cast back.

    Which is faster depends on the CPU, 2 threads: with bf16 dot-product instructions (2-core AMD EPYC, AVX512_BF16)
    torch's bf16 GEMM takes 0.57 ms for [256 x 1024] @ [1024 x 1024] and the float32 route 2.66
    (`.venv/bin/python benchmarks/resident_matmul.py gemm`); without them (the AVX2 development VM, an earlier
    session's measurement) torch's bf16 GEMM has no native kernel and runs ~6x slower than float32 with both
    conversions ([256 x 1024] @ [1024 x 448] then [256 x 224] @ [224 x 1024]: 27.9 vs 4.5 ms). One row (decode)
    stays in the compute dtype. Both accumulate in float32 and round once at the end, in different orders; resident
    and streamed runs call the same function on the same shapes in one process, so they stay bitwise equal.
    """
    if x.shape[0] > 1 and (x.dtype is torch.float16 or (x.dtype is torch.bfloat16 and not bf16_gemm())):
        return F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, w, bias)
