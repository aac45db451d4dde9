"""MXFP4 (OCP microscaling FP4): 32 e2m1 values sharing one E8M0 power-of-two scale.

Two layouts hold the same numbers:
- gpt-oss safetensors (issue 16): `*_blocks` uint8 [..., n/32, 16], two values per byte, the LOW nibble first
  (value 2i = low nibble of byte i), and `*_scales` uint8 [..., n/32], scale = 2^(s - 127). Reference:
  transformers' `convert_moe_packed_tensors` (before its final transpose).
- GGUF's MXFP4 block type (17 bytes: e, then 16 bytes whose low nibbles are values 0-15 and high nibbles 16-31):
  `ggml.dequantize(raw, "MXFP4")`, reference `gguf.quants.dequantize`.

Every value is a power of two times an integer of at most 3 bits, so the float32 product is exact (subnormal
results included) and the operation order does not matter. One corner differs between the references: s = 255
(NaN in the OCP spec, never written by a quantizer) is 2^127 here and in gguf, +-inf in transformers' ldexp.
And code 8 (negative zero) is -0.0 in the gpt-oss layout, as transformers gives it, and +0 in the GGUF type, as
gguf's integer table gives it.
"""

from __future__ import annotations

import torch

from .affine import Affine

#: e2m1 codes 0-15 -> value * 2 (the sign is bit 3): 0, .5, 1, 1.5, 2, 3, 4, 6 doubled, then the negatives.
#: Code 8 is -0.0 in e2m1 (and in transformers' table) but +0 in gguf's integer table.
_DOUBLED = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, -0.0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)
_DOUBLED_INT8 = _DOUBLED.to(torch.int8)


def fp4_doubled(codes: torch.Tensor, *, gguf: bool = False) -> torch.Tensor:
    """uint8 e2m1 codes (0-15) -> twice their value, exact: float32 keeping -0.0, or with gguf=True int8 (+0)."""
    return (_DOUBLED_INT8 if gguf else _DOUBLED)[codes.long()]


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponents -> float32 2^(e - 128), i.e. half the scale, built from its bits (ggml's
    ggml_e8m0_to_fp32_half): e < 2 are the subnormals 2^-128 and 2^-127."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """gpt-oss MXFP4 -> values.

    blocks: uint8 [..., G, 16]; scales: uint8 [..., G]; returns float32 [..., G * 32] (value 2i of a group is the
    low nibble of its byte i), or writes it into `out` (contiguous float32 / bfloat16 / float16 with that many
    elements; a non-float32 out receives the float32 values rounded once) and returns out.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks must be [..., G, 16] with scales [..., G], got {tuple(blocks.shape)} "
                         f"and {tuple(scales.shape)}")
    shape = (*blocks.shape[:-2], blocks.shape[-2] * 32)
    if out is not None and (out.numel() != blocks.numel() * 2 or not out.is_contiguous()
                            or out.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        raise ValueError(f"out must be a contiguous float32/bfloat16/float16 tensor of {blocks.numel() * 2} "
                         f"elements, got {out.dtype} {tuple(out.shape)}")
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).flatten(-2)  # [..., G, 32], interleaved
    value = fp4_doubled(codes)
    half = e8m0_half(scales).unsqueeze(-1)  # [..., G, 1]
    if out is None:
        return torch.mul(value, half).view(shape)
    if out.dtype == torch.float32:
        torch.mul(value, half, out=out.view(value.shape))
    else:
        out.view(value.shape).copy_(torch.mul(value, half))
    return out


def mxfp4_affine(blocks: torch.Tensor, scales: torch.Tensor) -> Affine:
    """gpt-oss MXFP4 [out, G, 16] + [out, G] -> Affine(int8 doubled codes [out, G * 32], 2^(s-128) per 32, no bias).

    Its dequantize equals dequantize_mxfp4 except that code 8 (negative zero) comes out +0.
    """
    if blocks.dim() != 3 or scales.dim() != 2:
        raise ValueError(f"MXFP4 weights must be blocks [out, G, 16] and scales [out, G], got "
                         f"{tuple(blocks.shape)} and {tuple(scales.shape)}")
    rows, groups = scales.shape
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).view(rows, groups * 32)
    return Affine(fp4_doubled(codes, gguf=True), e8m0_half(scales), None, 32)
