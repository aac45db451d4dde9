"""FP8 weights with block scales, as DeepSeek-V3 / R1, Kimi K2 and the Qwen3 FP8 uploads ship them.

A Linear's `weight` is float8_e4m3fn [out, in] and its `weight_scale_inv` holds one scale per block of
`block = (bn, bk)` weights (config.json `quantization_config.weight_block_size`, [128, 128] on the hub):
`scale_inv` [ceil(out / bn), ceil(in / bk)] in F32 (DeepSeek, Kimi) or BF16 / F16 (some Qwen3 uploads), and

    W[i, j] = float(weight[i, j]) * float32(scale_inv[i // bn, j // bk])

one float32 product per weight (the e4m3 value and the widened scale are exact in float32). The last block of a row
or column may be partial: DeepSeek's own kernel (inference/kernel.py weight_dequant) and transformers'
`_dequantize_fp8_weight` index blocks so. transformers' load-time `Fp8Dequantize` (what `from_pretrained` runs on a
CPU) instead derives the block from the grid (out // scale rows), which is the same whenever every dimension is a
multiple of the block or smaller than it, and otherwise wrong (192 rows in 2 blocks of 128 read as 2 of 96) or
refused (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows in 5 blocks). Where both index alike, `dequantize_fp8` is its
product bitwise (tests/quant/test_fp8.py).

`quantize_fp8` makes such weights from float ones the way the uploads were made: per block, scale = amax / 448
(e4m3's largest finite value), codes = round-to-nearest-even(w / scale) clamped to +-448.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def block_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of a weight [..., out, in] in blocks (bn, bk): [..., ceil(out / bn), ceil(in / bk)]."""
    *lead, rows, cols = shape
    bn, bk = block
    return (*lead, -(-rows // bn), -(-cols // bk))


def _expand(scales: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """scales [..., R, C] widened to float32 and repeated over their blocks, cut to `shape` [..., out, in]."""
    rows, cols = shape[-2:]
    s = scales.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    return s.repeat_interleave(block[1], dim=-1)[..., :cols]


def dequantize_fp8(weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """float8_e4m3fn weight [..., out, in] (or its bytes as uint8) and scales [..., ceil(out/bn), ceil(in/bk)]
    (float32 / bfloat16 / float16) -> float32 [..., out, in]; into `out` (contiguous float32 / bfloat16 / float16 of
    that many elements: the float32 values rounded once) when given. ValueError for a shape or dtype that does not
    fit."""
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.float8_e4m3fn)
    if weight.dtype != torch.float8_e4m3fn or scales.dtype not in SCALE_DTYPES:
        raise ValueError(f"FP8 weights must be float8_e4m3fn with float32 / bfloat16 / float16 scales, got "
                         f"{weight.dtype} and {scales.dtype}")
    if weight.dim() < 2 or tuple(scales.shape) != block_grid(tuple(weight.shape), block):
        raise ValueError(f"FP8 scales of a weight {list(weight.shape)} in blocks {list(block)} must be "
                         f"{list(block_grid(tuple(weight.shape), block)) if weight.dim() >= 2 else '[..., R, C]'}, "
                         f"got {list(scales.shape)}")
    w = weight.float() * _expand(scales, tuple(weight.shape), block)
    if out is None:
        return w
    if out.numel() != w.numel() or not out.is_contiguous() or out.dtype not in SCALE_DTYPES:
        raise ValueError(f"out must be a contiguous float32/bfloat16/float16 tensor of {w.numel()} elements, got "
                         f"{out.dtype} {tuple(out.shape)}")
    out.view(w.shape).copy_(w)
    return out


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] = (128, 128),
                 scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] (any float dtype) -> (float8_e4m3fn codes [..., out, in], scale_inv [..., ceil(out/bn),
    ceil(in/bk)] in scale_dtype): per block scale = amax / 448 rounded to scale_dtype (1 for an all-zero block) and
    codes = w / scale in float32, clamped to +-448, rounded to nearest even. So dequantize_fp8(codes, scale_inv)
    reproduces w to e4m3's 3 mantissa bits."""
    if w.dim() < 2 or scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"quantize_fp8 takes a weight [..., out, in] and a scale dtype in {SCALE_DTYPES}, got "
                         f"{list(w.shape)} and {scale_dtype}")
    *lead, rows, cols = w.shape
    bn, bk = block
    R, C = -(-rows // bn), -(-cols // bk)
    x = torch.zeros(*lead, R * bn, C * bk)  # float32, padded to whole blocks with zeros (they do not move amax)
    x[..., :rows, :cols] = w
    blocks = x.view(*lead, R, bn, C, bk)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., R, C]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).to(scale_dtype)
    q = (blocks / scale.float()[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(*lead, R * bn, C * bk)[..., :rows, :cols].contiguous(), scale
