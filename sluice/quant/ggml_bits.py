"""Fields of ggml blocks as torch tensors: what every block format's unpacking shares (ggml.py, ggml_k.py,
ggml_iq.py).

`blocks` is uint8 [..., block_bytes] and `qs` / `qh` a uint8 slice [..., m] of it; results keep the leading dims.
Everything here is exact (bit fields, f16 -> f32 widening); the float math of each format stays in its own module.
"""

from __future__ import annotations

import torch

_SHIFT8 = torch.arange(8, dtype=torch.uint8).view(8, 1)  # bit positions, LSB first
_SHIFT2 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)


def _copy(blocks: torch.Tensor, at: int, nbytes: int) -> torch.Tensor:
    """Bytes at:at+nbytes of each block in a fresh tensor: a wider dtype's view needs its offset aligned, which a
    slice of one block (contiguous, so .contiguous() would not copy) does not promise."""
    return blocks[..., at:at + nbytes].clone(memory_format=torch.contiguous_format)


def f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 field at byte `at` of each block, as float32 [..., 1] (exact)."""
    return _copy(blocks, at, 2).view(torch.float16).float()


def f16_bits(bits: torch.Tensor) -> torch.Tensor:
    """int32 [...] holding f16 bit patterns (0-65535) -> their float32 values [..., 1] (exact)."""
    pair = torch.stack((bits & 255, bits >> 8), dim=-1).to(torch.uint8)  # little-endian bytes [..., 2]
    return pair.view(torch.float16).float()


def u16(blocks: torch.Tensor, at: int, count: int) -> torch.Tensor:
    """`count` little-endian u16 words from byte `at`, as int32 [..., count] (0-65535)."""
    return _copy(blocks, at, 2 * count).view(torch.int16).to(torch.int32) & 0xFFFF


def u32(blocks: torch.Tensor, at: int, count: int) -> torch.Tensor:
    """`count` little-endian u32 words from byte `at`, as int64 [..., count]."""
    return _copy(blocks, at, 4 * count).view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., m] bytes -> [..., 2, m]: the low nibbles, then the high nibbles (ggml's order within a sub-block)."""
    return torch.stack((qs & 15, qs >> 4), dim=-2)


def crumbs(qs: torch.Tensor) -> torch.Tensor:
    """[..., m] bytes -> [..., 4, m]: row j holds bits 2j, 2j+1 of every byte (the 2-bit fields, lowest first)."""
    return (qs.unsqueeze(-2) >> _SHIFT2) & 3


def bits(qh: torch.Tensor) -> torch.Tensor:
    """[..., m] bytes -> [..., 8, m]: bit j of every byte in row j (LSB first)."""
    return (qh.unsqueeze(-2) >> _SHIFT8) & 1


def per_byte(fields: torch.Tensor) -> torch.Tensor:
    """[..., k, m] fields as nibbles / crumbs / bits return them -> [..., m * k]: byte by byte, the fields of each
    byte lowest first (the order of the formats whose scales or signs run along the bytes: IQ2_XS, IQ3_S, ...)."""
    return fields.transpose(-1, -2).flatten(-2)
