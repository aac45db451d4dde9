"""Dequantization of ggml block formats (GGUF tensor data) in torch, bitwise equal to the `gguf` package.

`dequantize(raw, fmt)` turns whole rows of raw little-endian block bytes into float32 values. Each format follows
the exact float32 operation order of `gguf.quants` (the reference; it mirrors llama.cpp's `dequantize_row_*`):
every scale is first widened to float32 (f16 -> f32 is exact), products and sums are rounded once each, in the
order written in the comments below. No fused multiply-add anywhere: torch runs each elementwise op separately, so
`a * b + c` is two roundings, as in numpy. Integers (nibbles, 5/6-bit values, offsets) are exact in float32, so an
offset subtracted before the float conversion gives the same bits as the reference's int8 arithmetic.

All work is vectorised over blocks: a format is a handful of bitwise ops on the [rows, blocks, bytes] view. Each
format is split into integer codes and float32 scales (affine.py); this file holds the legacy types, Q4_K-Q6_K and
MXFP4, ggml_k.py Q2_K, Q3_K and the ternary TQ types, ggml_iq.py the IQ types and their grids.
"""

from __future__ import annotations

import torch

from .affine import Affine
from ..checkpoint.formats import BY_NAME, BlockFormat, UnsupportedFormat
from .ggml_bits import bits, crumbs, f16, nibbles, per_byte
from .ggml_iq import IQ_SPLIT
from .ggml_k import LOW_SPLIT
from .mxfp4 import e8m0_half, fp4_doubled


def block_format(fmt: str | BlockFormat) -> BlockFormat:
    """The BlockFormat of a name (gguf's GGMLQuantizationType name) or itself; UnsupportedFormat when unknown."""
    if isinstance(fmt, BlockFormat):
        return fmt
    found = BY_NAME.get(fmt)
    if found is None:
        raise UnsupportedFormat(str(fmt), "it is not a ggml type")
    return found


def _rows(raw: torch.Tensor, f: BlockFormat, shape: tuple[int, ...] | None) -> tuple[int, int]:
    """Check raw against the format and the values' shape; (rows, n) of the values."""
    if f.name not in DEQUANTIZABLE:
        raise UnsupportedFormat(f.name, "sluice has no dequantization for it")
    if raw.dtype != torch.uint8:
        raise ValueError(f"{f.name} data must be uint8 bytes, got {raw.dtype}")
    if shape is None:
        if raw.dim() != 2 or raw.shape[1] % f.block_bytes:
            raise ValueError(f"{f.name} rows must be [rows, k*{f.block_bytes}] bytes, got {tuple(raw.shape)}")
        shape = (raw.shape[0], raw.shape[1] // f.block_bytes * f.block_elems)
    n = int(shape[-1]) if len(shape) else 1
    numel = 1
    for s in shape:
        numel *= int(s)
    want = numel // n * f.row_nbytes(n) if n else 0
    if raw.numel() != want:
        raise ValueError(f"{f.name} values of shape {tuple(shape)} take {want} bytes, got {raw.numel()}")
    return (numel // n if n else 0), n


def affine(raw: torch.Tensor, fmt: str | BlockFormat, shape: tuple[int, ...] | None = None, *,
           codes: bool = True) -> Affine:
    """Whole rows of a scaled ggml format -> Affine(codes [rows, n], scale, bias, group) (see affine.py's table).

    raw and shape as in `dequantize`. codes=False skips unpacking the codes (the slow part): codes is then None.
    Plain formats (F32, F16, BF16) have no codes: ValueError.
    """
    f = block_format(fmt)
    rows, n = _rows(raw, f, shape)
    if f.plain:
        raise ValueError(f"{f.name} is a plain float format, it has no codes and scales")
    blocks = raw.reshape(-1, f.block_bytes)  # [n_blocks, block_bytes]
    unpack, scale, bias, group = _SPLIT[f.name](blocks)
    return Affine(unpack().reshape(rows, n) if codes else None, scale.reshape(rows, n // group),
                  None if bias is None else bias.reshape(rows, n // group), group)


def dequantize(raw: torch.Tensor, fmt: str | BlockFormat, shape: tuple[int, ...] | None = None, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Whole rows of ggml blocks -> their values.

    raw: uint8, either [rows, row_bytes] (the values come back as [rows, n]) or any uint8 tensor with `shape` giving
    the values' shape (last dim n, a whole number of blocks). out: optional preallocated tensor with as many
    elements, float32 / bfloat16 / float16, contiguous; the float32 values are rounded once into its dtype and it
    is returned. Without out, a new float32 tensor. Raises UnsupportedFormat (a ValueError naming the type) for a
    type outside DEQUANTIZABLE and ValueError for a byte count that is not whole rows; callers that know the tensor
    wrap both into CheckpointError.
    """
    f = block_format(fmt)
    rows, n = _rows(raw, f, shape)
    shape = tuple(shape) if shape is not None else (rows, n)
    if out is not None and (out.numel() != rows * n or not out.is_contiguous()
                            or out.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        raise ValueError(f"out must be a contiguous float32/bfloat16/float16 tensor of {rows * n} elements, "
                         f"got {out.dtype} {tuple(out.shape)}")
    if not f.plain:
        values = affine(raw, f, shape).dequantize(out)
        return out if out is not None else values.view(shape)
    # F32 / F16 / BF16: widening to float32 is exact (f16 by value, bf16 a 16-bit shift); one rounding into out
    values = raw.contiguous().view(_PLAIN[f.name]).view(shape)
    if out is None:
        return values.float()
    out.view(shape).copy_(values)
    return out


def _q8_0(b):
    # d(f16) qs[32](int8):  x * d
    return lambda: b[..., 2:].view(torch.int8), f16(b, 0), None, 32


def _q4_0(b):
    # d(f16) qs[16]: element j < 16 is the low nibble of qs[j], j >= 16 the high nibble of qs[j-16];  d * (q - 8)
    return lambda: nibbles(b[..., 2:]).flatten(-2).view(torch.int8).sub_(8), f16(b, 0), None, 32


def _q4_1(b):
    # d(f16) m(f16) qs[16]:  (d * q) + m
    return lambda: nibbles(b[..., 4:]).flatten(-2), f16(b, 0), f16(b, 2), 32


def _q5(b, at_qh):
    # qh: 4 bytes = a little-endian u32 whose bit j is bit 4 of element j; then 16 bytes of nibbles as in Q4_0
    hi = per_byte(bits(b[..., at_qh:at_qh + 4]))  # [.., 32]: byte j//8, bit j%8
    return nibbles(b[..., at_qh + 4:]).flatten(-2) | (hi << 4)


def _q5_0(b):
    # d(f16) qh[4] qs[16]:  d * (q - 16)
    return lambda: _q5(b, 2).view(torch.int8).sub_(16), f16(b, 0), None, 32


def _q5_1(b):
    # d(f16) m(f16) qh[4] qs[16]:  (d * q) + m
    return lambda: _q5(b, 4), f16(b, 0), f16(b, 2), 32


def k_scale_min(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 12 packed scale bytes [..., 12] -> (scales, mins), each [..., 8] uint8 6-bit values.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for mins; bytes
    8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble) (ggml's get_scale_min_k4).
    """
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scales = torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), dim=-1)
    mins = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), dim=-1)
    return scales, mins


def _k_scales(b):
    # Q4_K / Q5_K: per 32-value sub-block s:  (d * sc[s]) * q - (dmin * m[s]), each product rounded to float32;
    # the subtraction is the addition of the negated product, bitwise
    sc, mn = k_scale_min(b[..., 4:16])
    return f16(b, 0) * sc, (f16(b, 2) * mn).neg_()  # [.., nb, 8] each


def _q4_k(b):
    # d(f16) dmin(f16) scales[12] qs[128]: sub-block 2i = low nibbles of qs[32i:32i+32], 2i+1 = their high nibbles
    return (lambda: nibbles(b[..., 16:].unflatten(-1, (4, 32))).flatten(-3, -2), *_k_scales(b), 32)  # [.., nb, 8, 32]


def _q5_k(b):
    # d dmin scales[12] qh[32] qs[128]: as Q4_K, plus bit s of qh[l] as bit 4 of value l of sub-block s
    def codes():
        lo = nibbles(b[..., 48:].unflatten(-1, (4, 32))).flatten(-3, -2)
        return lo | (bits(b[..., 16:48]) << 4)  # [.., nb, 8, 32]
    return (codes, *_k_scales(b), 32)


def _q6_k(b):
    # ql[128] qh[64] scales[16](int8) d(f16): value = (d * sc[s]) * (q - 32) per 16-value sub-block s; per 128-value
    # half h: q = low 4 bits from ql[64h:64h+64] (low nibbles, then high nibbles), top 2 bits from qh[32h:32h+32]
    def codes():
        ql = nibbles(b[..., 0:128].unflatten(-1, (2, 64))).unflatten(-1, (2, 32))  # [.., nb, 2(h), 2(shift), 2, 32]
        qh = crumbs(b[..., 128:192].unflatten(-1, (2, 32)))  # [.., nb, 2(h), 4(shift), 32]
        return (ql.flatten(-4, -2) | (qh.flatten(-3, -2) << 4)).view(torch.int8).sub_(32)  # [.., nb, 8, 32]
    return codes, f16(b, 208) * b[..., 192:208].view(torch.int8), None, 16  # scale [.., nb, 16]


def _mxfp4(b):
    # e(e8m0) qs[16]: element j < 16 = low nibble of qs[j], j >= 16 = high nibble of qs[j-16] (ggml's layout, unlike
    # gpt-oss's interleaved one);  2^(e-128) * (2 * fp4 value), exact. gguf's integer table: code 8 is +0.
    return lambda: fp4_doubled(nibbles(b[..., 1:]).flatten(-2), gguf=True), e8m0_half(b[..., 0:1]), None, 32


_PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_SPLIT = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q4_K": _q4_k, "Q5_K": _q5_k,
    "Q6_K": _q6_k, "MXFP4": _mxfp4, **LOW_SPLIT, **IQ_SPLIT,
}
#: the ggml types `dequantize` computes: the legacy and K-quants of issue 14, MXFP4 (issue 16), and the 1-3 bit
#: K, IQ and ternary types of the largest MoE files (issue 32); formats.SUPPORTED names the same set
DEQUANTIZABLE = frozenset(_PLAIN) | frozenset(_SPLIT)
