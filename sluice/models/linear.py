"""The projection every resident weight of the model math goes through: a plain tensor runs torch (one row in the
compute dtype, several in float32 or bf16 by the model's Compute.bf16_gemm: quant/matmul.py rows_linear), a
QuantLinear (GGUF blocks kept resident, quant/linear.py) its own row-count ladder."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant.linear import QuantLinear
from ..quant.matmul import rows_linear


def linear(x: torch.Tensor, w: torch.Tensor | QuantLinear, bias: torch.Tensor | None = None,
           bf16: bool = False) -> torch.Tensor:
    """x [T, in] @ w^T (+ bias) -> [T, out] in the compute dtype: a QuantLinear's ladder, else rows_linear (several
    bf16 rows in float32 unless `bf16`, the model's Compute.bf16_gemm: on AVX2 torch's bf16 GEMM has no native
    kernel, [33 x 1024] x [1024 x 1024]^T 3.7-4.1 ms bf16, 1.3-1.6 float32)."""
    if type(w) is QuantLinear:
        return w.linear(x, bias)
    return rows_linear(x, w, bias, bf16)


def logits(x: torch.Tensor, w: torch.Tensor | QuantLinear) -> torch.Tensor:
    """x [T, H] @ lm_head^T -> float32 [T, V]. A QuantLinear's float32 result is returned as is, not rounded to the
    compute dtype first."""
    if type(w) is QuantLinear:
        return w.linear(x, out_dtype=torch.float32)
    return F.linear(x, w).float()
