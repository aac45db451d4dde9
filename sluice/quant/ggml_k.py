"""The 2-3 bit K-quants (Q2_K, Q3_K) and the ternary types (TQ1_0, TQ2_0): 256-value super-blocks split into
integer codes and float32 scales, bitwise the `gguf` package's dequantization (ggml.py's conventions: one rounding
per product and sum, in the reference's order, written next to each format).

| format | code | scale | bias | group |
|---|---|---|---|---|
| Q2_K | q (0-3) | d * (sc & 15) | -(dmin * (sc >> 4)) | 16 |
| Q3_K | q - 4 * (1 - hbit) (-4..3) | d * (sc6 - 32) | - | 16 |
| TQ1_0 / TQ2_0 | t - 1 (-1..1) | d | - | 256 |
"""

from __future__ import annotations

import torch

from .ggml_bits import bits, crumbs, f16, nibbles

# TQ1_0 packs 5 base-3 digits per byte (4 in the qh bytes) as a fraction of 256: digit j of byte x is the integer
# part of 3 * (x * 3^j mod 256) / 256, i.e. ((x * 3^j) & 255) * 3 >> 8 (ggml's dequantize_row_tq1_0)
_POW3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32).view(5, 1)


def _q2_k(b):
    # scales[16] qs[64] d(f16) dmin(f16): per 16-value sub-block s, (d * (sc[s] & 15)) * q - (dmin * (sc[s] >> 4)),
    # each product rounded once, the subtraction the addition of the negated product (bitwise); value 128h + 32j + l
    # is bits 2j, 2j+1 of qs[32h + l]
    sc = b[..., 0:16]
    scale, bias = f16(b, 80) * (sc & 15), (f16(b, 82) * (sc >> 4)).neg_()  # [.., nb, 16] each
    return lambda: crumbs(b[..., 16:80].unflatten(-1, (2, 32))).flatten(-3), scale, bias, 16


def _q3_k(b):
    # hmask[32] qs[64] scales[12] d(f16): per 16-value sub-block s, (d * (sc[s] - 32)) * q. q's low 2 bits as Q2_K's;
    # bit j of hmask[l] is the high bit of value 32j + l, and a CLEAR bit subtracts 4 (q = low - 4 * (1 - high)).
    # The 6-bit scales: low 4 bits from the low nibbles of bytes 0-7 (s < 8) then their high nibbles (s >= 8), top 2
    # bits of scale 4k + j from bits 2k, 2k+1 of byte 8 + j.
    sc = b[..., 96:108]
    sc6 = nibbles(sc[..., 0:8]).flatten(-2) | (crumbs(sc[..., 8:12]).flatten(-2) << 4)  # [.., nb, 16] 0-63
    scale = f16(b, 108) * (sc6.view(torch.int8) - 32)

    def codes():
        low = crumbs(b[..., 32:96].unflatten(-1, (2, 32))).flatten(-3)  # [.., nb, 256]
        high = bits(b[..., 0:32]).flatten(-2)  # [.., nb, 256]
        return (low | (high << 2)).view(torch.int8).sub_(4)
    return codes, scale, None, 16


def _tq1_0(b):
    # qs[48] qh[4] d(f16): d * (t - 1) for base-3 digits t; value 32j + l is digit j of qs[l] (l < 32), value
    # 160 + 16j + l digit j of qs[32 + l] (l < 16), value 240 + 4j + l digit j of qh[l] (j < 4)
    def digits(x: torch.Tensor, k: int) -> torch.Tensor:  # [.., m] bytes -> [.., k * m]: digit j of byte l at jm + l
        return ((((x.unsqueeze(-2).to(torch.int32) * _POW3[:k]) & 255) * 3) >> 8).flatten(-2)

    def codes():
        t = torch.cat((digits(b[..., 0:32], 5), digits(b[..., 32:48], 5), digits(b[..., 48:52], 4)), dim=-1)
        return (t - 1).to(torch.int8)  # [.., nb, 256]
    return codes, f16(b, 52), None, 256


def _tq2_0(b):
    # qs[64] d(f16): d * (t - 1); value 128h + 32j + l is bits 2j, 2j+1 of qs[32h + l] (Q2_K's order)
    return (lambda: crumbs(b[..., 0:64].unflatten(-1, (2, 32))).flatten(-3).view(torch.int8).sub_(1),
            f16(b, 64), None, 256)


#: name -> the block splitter ggml.py's affine() calls: blocks uint8 [nb, block_bytes] -> (codes(), scale, bias, group)
LOW_SPLIT = {"Q2_K": _q2_k, "Q3_K": _q3_k, "TQ1_0": _tq1_0, "TQ2_0": _tq2_0}
