"""The IQ types (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS): codes and float32 scales,
bitwise the `gguf` package's dequantization (ggml.py's conventions, the reference's order next to each format).

Most IQ types store, per row of 8 (IQ3: 4) values, an index into a grid of value rows (ggml_grids.py) and a sign
pattern; the value is a float32 block scale times the grid value times +-1. The reference computes
(scale * grid) * sign; multiplying by +-1 is exact, so that is scale * (sign * grid) with the signed grid value as an
int8 code (signed zeros agree too: no grid value is 0). IQ1_S / IQ1_M compute scale * (grid + delta) with delta =
+-1/8 and grid in {-1, 0, 1}: that is (scale / 8) * (8 * grid +- 1), the same real product (scale / 8 is exact), so
the same rounding, with int8 codes 8 * grid +- 1. IQ4_NL / IQ4_XS look their 4-bit codes up in 16 fixed values.

| format | code | scale | group |
|---|---|---|---|
| IQ2_XXS | +-grid (8, 25, 43) | (d * (0.5 + s)) * 0.25 | 32 |
| IQ2_XS / IQ2_S | +-grid | (d * (0.5 + s)) * 0.25 | 16 |
| IQ3_XXS | +-grid (4..62) | (d * (0.5 + s)) * 0.5 | 32 |
| IQ3_S | +-grid (1..15) | d * (1 + 2s) | 32 |
| IQ1_S | 8 * grid +- 1 | (d * (2s + 1)) / 8 | 32 |
| IQ1_M | 8 * grid +- 1 | (d * (2s + 1)) / 8 | 16 |
| IQ4_NL / IQ4_XS | kvalues[q] (-127..113) | d / d * (s - 32) | 32 |
"""

from __future__ import annotations

import functools

import torch

from .ggml_bits import bits, crumbs, f16, f16_bits, nibbles, per_byte, u16, u32
from .ggml_grids import GRIDS, IQ4_NL_VALUES

_IQ4 = torch.tensor(IQ4_NL_VALUES, dtype=torch.int8)
_SEVEN = torch.tensor([0, 7, 14, 21], dtype=torch.int64)  # the four 7-bit sign indices of a u32
_IQ1_SHIFTS = torch.tensor([0, 3, 6, 9], dtype=torch.int32)  # the four 3-bit fields of a u16


@functools.cache
def grid(name: str) -> torch.Tensor:
    """The grid of an IQ type (IQ1_M uses IQ1_S's) as int8 [rows, 8 or 4], decoded from ggml_grids.GRIDS."""
    rows, width, levels, nbits, lines = GRIDS[name]
    packed = torch.frombuffer(bytearray.fromhex("".join(lines)), dtype=torch.uint8)
    shifts = torch.arange(0, 8, nbits, dtype=torch.uint8)
    index = (packed.unsqueeze(-1) >> shifts) & ((1 << nbits) - 1)  # [bytes, 8 / nbits], lowest bits first
    return torch.tensor(levels, dtype=torch.int8)[index.flatten()[: rows * width].long()].view(rows, width)


@functools.cache
def sign_rows() -> torch.Tensor:
    """int8 [128, 8] of +-1: the sign pattern a 7-bit index stands for (ggml's ksigns_iq2xs): bit j of the index
    negates value j, and value 7 is negated when the index has an odd number of set bits (an even count of
    negatives in every pattern)."""
    k = torch.arange(128)
    odd = sum((k >> j) & 1 for j in range(7)) & 1
    pattern = (k | (odd << 7)).unsqueeze(-1) >> torch.arange(8)  # [128, 8]
    return (1 - 2 * (pattern & 1)).to(torch.int8)


def _signed(name: str, index: torch.Tensor, negate: torch.Tensor) -> torch.Tensor:
    """Grid rows `index` [...] of `name` with the values where `negate` [..., width] is 1 negated: int8 [..., width]."""
    return grid(name)[index.long()] * (1 - 2 * negate.to(torch.int8))


def _iq2_xxs(b):
    # d(f16), then 8 bytes per 32-value sub-block: 4 grid indices (rows l = 0-3 of 8 values) and a u32 whose bits
    # 7l..7l+6 are row l's sign index and whose top 4 bits are s;  ((d * (0.5 + s)) * 0.25) * grid * sign
    q = b[..., 2:66].unflatten(-1, (8, 8))  # [.., nb, 8, 8]
    aux = u32(q, 4, 1)  # [.., nb, 8, 1]
    scale = f16(b, 0) * ((aux[..., 0] >> 28).float() + 0.5) * 0.25  # [.., nb, 8]

    def codes():
        signs = sign_rows()[(aux >> _SEVEN) & 127]  # [.., nb, 8, 4, 8]
        return (grid("IQ2_XXS")[q[..., 0:4].long()] * signs).flatten(-3)
    return codes, scale, None, 32


def _iq2_scales(b, at: int) -> torch.Tensor:
    # IQ2_XS / IQ2_S: 8 bytes of 4-bit scales s (low nibble first) for 16 values each;  (d * (0.5 + s)) * 0.25
    return f16(b, 0) * (per_byte(nibbles(b[..., at:at + 8])).float() + 0.5) * 0.25  # [.., nb, 16]


def _iq2_xs(b):
    # d(f16) qs[32](u16) scales[8]: each u16 is a grid index (low 9 bits) and a sign index (high 7) for 8 values
    def codes():
        w = u16(b, 2, 32)  # [.., nb, 32]
        return (grid("IQ2_XS")[(w & 511).long()] * sign_rows()[(w >> 9).long()]).flatten(-2)
    return codes, _iq2_scales(b, 66), None, 16


def _iq2_s(b):
    # d(f16) qs[32] signs[32] qh[8] scales[8]: row i of 8 values is grid index qs[i] | (2 bits of qh) << 8 (row
    # 4j + k: bits 2k, 2k+1 of qh[j]), bit k of signs[i] negates its value k
    def codes():
        index = b[..., 2:34].to(torch.int32) | (per_byte(crumbs(b[..., 66:74])).to(torch.int32) << 8)  # [.., nb, 32]
        return _signed("IQ2_S", index, bits(b[..., 34:66]).transpose(-1, -2)).flatten(-2)
    return codes, _iq2_scales(b, 74), None, 16


def _iq3_xxs(b):
    # d(f16) qs[64] then a u32 per 32-value sub-block: sign indices of its 4 rows of 8 (7 bits each, as IQ2_XXS),
    # top 4 bits s;  ((d * (0.5 + s)) * 0.5) * grid * sign, qs[8ib + 2l + h] the grid row (4 values) of values
    # 8l + 4h .. of sub-block ib
    aux = u32(b, 66, 8)  # [.., nb, 8]
    scale = f16(b, 0) * ((aux >> 28).float() + 0.5) * 0.5

    def codes():
        values = grid("IQ3_XXS")[b[..., 2:66].long()].flatten(-2).unflatten(-1, (8, 4, 8))  # [.., nb, 8, 4, 8]
        return (values * sign_rows()[(aux.unsqueeze(-1) >> _SEVEN) & 127]).flatten(-3)
    return codes, scale, None, 32


def _iq3_s(b):
    # d(f16) qs[64] qh[8] signs[32] scales[4]: grid row i (4 values) is qs[i] | (bit k of qh[j]) << 8 for i = 8j + k;
    # bit k of signs[i] negates value 8i + k; 4-bit scales s (low nibble first) per 32 values:  (d * (1 + 2s)) * ...
    scale = f16(b, 0) * (1 + 2 * per_byte(nibbles(b[..., 106:110])))  # [.., nb, 8]: 1 + 2s exact in uint8

    def codes():
        index = b[..., 2:66].to(torch.int32) | (per_byte(bits(b[..., 66:74])).to(torch.int32) << 8)  # [.., nb, 64]
        return _signed("IQ3_S", index, per_byte(bits(b[..., 74:106])).unflatten(-1, (64, 4))).flatten(-2)
    return codes, scale, None, 32


def _iq1_codes(index: torch.Tensor, minus: torch.Tensor) -> torch.Tensor:
    """8 * grid + 1, or - 1 where `minus` [..., rows] is set, for the IQ1 grid rows `index` [..., rows]: int8
    [..., rows * 8]."""
    return (grid("IQ1_S")[index.long()] * 8 + (1 - 2 * minus.to(torch.int8)).unsqueeze(-1)).flatten(-2)


def _iq1_s(b):
    # d(f16) qs[32] qh[8](u16): per 32-value sub-block ib, qh[ib] holds the high 3 bits of its 4 grid rows (bits
    # 3l..3l+2), s (bits 12-14) and the sign of delta (bit 15);  (d * (2s + 1)) * (grid + delta), delta +-1/8
    qh = u16(b, 34, 8)  # [.., nb, 8]
    scale = f16(b, 0) * (2 * ((qh >> 12) & 7) + 1) * 0.125

    def codes():
        high = ((qh.unsqueeze(-1) >> _IQ1_SHIFTS) & 7).flatten(-2)  # [.., nb, 32]: row 4ib + l
        index = b[..., 2:34].to(torch.int32) | (high << 8)
        return _iq1_codes(index, (qh >> 15).repeat_interleave(4, dim=-1))
    return codes, scale, None, 32


def _iq1_m(b):
    # qs[32] qh[16] scales[4](u16): d is the f16 made of the top nibbles of the four scale words (word 0's lowest);
    # their low 12 bits hold 16 3-bit scales s (word w bits 3k.. for s[4w + k]), one per 16 values. Nibble h of
    # qh[j] belongs to grid row 2j + h: 3 high index bits, and bit 3 the sign of that row's delta;
    # (d * (2s + 1)) * (grid + delta)
    sc = u16(b, 48, 4)  # [.., nb, 4]
    d = f16_bits((sc[..., 0] >> 12) | ((sc[..., 1] >> 8) & 0xF0) | ((sc[..., 2] >> 4) & 0xF00) | (sc[..., 3] & 0xF000))
    scale = d * (2 * ((sc.unsqueeze(-1) >> _IQ1_SHIFTS) & 7).flatten(-2) + 1) * 0.125  # [.., nb, 16]

    def codes():
        qh = per_byte(nibbles(b[..., 32:48])).to(torch.int32)  # [.., nb, 32]
        return _iq1_codes(b[..., 0:32].to(torch.int32) | ((qh & 7) << 8), qh >> 3)
    return codes, scale, None, 16


def _iq4_nl(b):
    # d(f16) qs[16]: d * kvalues[q], value j < 16 the low nibble of qs[j], j >= 16 the high nibble of qs[j - 16]
    return lambda: _IQ4[nibbles(b[..., 2:18]).flatten(-2).long()], f16(b, 0), None, 32


def _iq4_xs(b):
    # d(f16) scales_h(u16) scales_l[4] qs[128]: 6-bit scale s of sub-block ib = nibble ib of scales_l (low first)
    # | bits 2ib, 2ib+1 of scales_h << 4;  (d * (s - 32)) * kvalues[q], the 32 values of ib coded as IQ4_NL's in
    # qs[16ib:16ib + 16]
    high = (u16(b, 2, 1) >> torch.arange(0, 16, 2, dtype=torch.int32)) & 3  # [.., nb, 8]
    s = per_byte(nibbles(b[..., 4:8])).to(torch.int32) | (high << 4)
    scale = f16(b, 0) * (s - 32)
    return lambda: _IQ4[nibbles(b[..., 8:136].unflatten(-1, (8, 16))).flatten(-3).long()], scale, None, 32


#: name -> the block splitter ggml.py's affine() calls: blocks uint8 [nb, block_bytes] -> (codes(), scale, bias, group)
IQ_SPLIT = {"IQ1_S": _iq1_s, "IQ1_M": _iq1_m, "IQ2_XXS": _iq2_xxs, "IQ2_XS": _iq2_xs, "IQ2_S": _iq2_s,
            "IQ3_XXS": _iq3_xxs, "IQ3_S": _iq3_s, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}
