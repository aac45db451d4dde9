"""The common shape of every scaled format once its bits are unpacked: value = scale * code (+ bias) per group.

Every format sluice reads is, after unpacking, small integer codes with one float32 scale (and for some an additive
float32 bias) per group of `group` consecutive values of a row:

| format | code | scale | bias | group |
|---|---|---|---|---|
| Q4_0 / Q5_0 / Q8_0 | q - 8 / q - 16 / q (int8) | d | - | 32 |
| Q4_1 / Q5_1 | q (0-15 / 0-31) | d | m | 32 |
| Q4_K / Q5_K | q (0-15 / 0-31) | d * sc | -(dmin * m) | 32 |
| Q6_K | q - 32 (int8) | d * sc | - | 16 |
| MXFP4 (GGUF) | 2 * e2m1 value (int8) | 2^(e-128) | - | 32 |
| MLX affine | q (0 - 2^bits-1) | scale | bias | 32 / 64 / 128 |
| Q2_K, Q3_K, TQ1_0, TQ2_0 | ggml_k.py's table | | | 16 / 256 |
| IQ1_S ... IQ4_XS | ggml_iq.py's table (grid values with their signs, int8) | | - | 16 / 32 |

`scale * code` then `+ bias`, each rounded once in float32, is exactly the reference's operation order for each of
these (x - y is x + (-y) in IEEE arithmetic, so the K-quants' subtraction is the same addition), so
`Affine.dequantize` is bitwise the reference dequantization. Unpacking is the slow part (a dozen bitwise passes);
applying the scales is one or two passes; so an Affine is also the "codes" form a slot can hold for the exact path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Affine:
    """codes [rows, n] int8/uint8 (None when only the scales were asked for); scale, bias (or None) float32
    [rows, n / group]."""

    codes: torch.Tensor | None
    scale: torch.Tensor
    bias: torch.Tensor | None
    group: int

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 values [rows, n] (scale * code, then + bias), or written into `out` (contiguous float32 /
        bfloat16 / float16 with rows * n elements; a non-float32 out gets the float32 values rounded once)."""
        rows, n = self.codes.shape
        if out is not None and (out.numel() != rows * n or not out.is_contiguous() or out.dtype not in _FLOATS):
            raise ValueError(f"out must be a contiguous float32/bfloat16/float16 tensor of {rows * n} elements, "
                             f"got {out.dtype} {tuple(out.shape)}")
        direct = out is not None and out.dtype == torch.float32
        dst = out if direct else torch.empty(rows, n, dtype=torch.float32)
        apply_affine(self.codes, self.scale, self.bias, self.group, dst)
        if out is None:
            return dst
        if not direct:
            out.view(rows, n).copy_(dst.view(rows, n))
        return out


def apply_affine(codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, group: int,
                 dst: torch.Tensor) -> torch.Tensor:
    """dst (float32, rows * n elements) = scale * codes (+ bias), group-wise; the one place the math happens.

    The codes are widened into dst first (exact) and the scale applied in place: the same float32 product as a
    mixed-dtype multiply, but 0.29 ms instead of 0.85 ms for 768 x 2048 codes (one thread, dev VM), which casts
    the codes into a temporary first.
    """
    rows, n = codes.shape
    g = dst.view(rows, n // group, group)
    g.copy_(codes.view(rows, n // group, group))
    g.mul_(scale.view(rows, n // group, 1))
    if bias is not None:
        g.add_(bias.view(rows, n // group, 1))
    return dst
