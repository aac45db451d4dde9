"""MLX affine and gpt-oss MXFP4 dequantization against their references (mlx.core.dequantize, transformers, gguf)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.quant.ggml import dequantize
from sluice.quant.mlx import dequantize_mlx, mlx_affine
from sluice.quant.mxfp4 import dequantize_mxfp4, mxfp4_affine

TORCH_OF = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def quantized_mlx(bits: int, group: int, scale_dtype: str, seed: int = 0):
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(seed)
    w = mx.array((rng.standard_normal((24, 256)) * 0.02).astype(np.float32))
    wq, s, b = mx.quantize(w, group_size=group, bits=bits)
    s, b = s.astype(getattr(mx, scale_dtype)), b.astype(getattr(mx, scale_dtype))
    as_torch = [torch.from_numpy(np.array(t.astype(mx.float32))).to(TORCH_OF[scale_dtype]) for t in (s, b)]
    return mx, (wq, s, b), (torch.from_numpy(np.array(wq).view(np.int32)), *as_torch)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_mlx_float32_scales_match_mx_dequantize_bitwise(bits, group):
    mx, (wq, s, b), (tw, ts, tb) = quantized_mlx(bits, group, "float32")
    want = np.array(mx.dequantize(wq, s, b, group_size=group, bits=bits))
    got = dequantize_mlx(tw, ts, tb, bits=bits, group_size=group).numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("scale_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("bits", [4, 8])
def test_mlx_half_scales_are_widened_then_computed_in_float32(scale_dtype, bits):
    mx, (wq, s, b), (tw, ts, tb) = quantized_mlx(bits, 64, scale_dtype, seed=1)
    f32 = mx.float32
    want = np.array(mx.dequantize(wq, s.astype(f32), b.astype(f32), group_size=64, bits=bits))
    got = dequantize_mlx(tw, ts, tb, bits=bits, group_size=64).numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # MLX itself computes in the scales' dtype: a rounding after the multiply and one after the add, each within
    # half a unit of the larger operand's last place (bf16: 2^-8 relative, f16: 2^-11)
    native = np.array(mx.dequantize(wq, s, b, group_size=64, bits=bits).astype(f32))
    ulp = 2.0 ** -8 if scale_dtype == "bfloat16" else 2.0 ** -11
    size = (ts.float().abs() * (2 ** bits - 1) + tb.float().abs()).repeat_interleave(64, dim=1).numpy()
    assert np.all(np.abs(native - got) <= ulp * size)
    assert not np.array_equal(native, got)  # the reason for widening: MLX's own bf16/f16 values differ


def test_mlx_shape_errors():
    w = torch.zeros(4, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="scales and biases"):
        mlx_affine(w, torch.zeros(4, 1), torch.zeros(4, 2), bits=4, group_size=64)
    with pytest.raises(ValueError, match="bits"):
        mlx_affine(w, torch.zeros(4, 1), torch.zeros(4, 1), bits=7, group_size=64)
    with pytest.raises(ValueError, match="takes"):
        mlx_affine(w, torch.zeros(4, 1), torch.zeros(4, 1), bits=4, group_size=32)


def gpt_oss_blocks(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 255, (3, 8, 4), dtype=torch.uint8, generator=g)
    scales[0, 0] = torch.tensor([0, 1, 2, 254])  # subnormal and largest finite scales
    return blocks, scales


def test_mxfp4_matches_transformers_bitwise():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = gpt_oss_blocks()
    want = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # -> [E, out, in]
    got = dequantize_mxfp4(blocks, scales)
    assert torch.equal(got.view(torch.int32), want.contiguous().view(torch.int32))  # -0.0 included


def test_mxfp4_gguf_block_type_matches_gguf_bitwise():
    gguf = pytest.importorskip("gguf")
    raw = np.random.default_rng(4).integers(0, 255, (5, 17 * 4), dtype=np.uint8)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    got = dequantize(torch.from_numpy(raw), "MXFP4").numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_mxfp4_affine_equals_dequantize_up_to_the_sign_of_zero():
    blocks, scales = gpt_oss_blocks(1)
    exact = dequantize_mxfp4(blocks[0], scales[0])
    a = mxfp4_affine(blocks[0], scales[0]).dequantize()
    assert torch.equal(a, exact)  # == treats -0 and +0 alike
    out = torch.empty(8, 128, dtype=torch.bfloat16)
    assert torch.equal(dequantize_mxfp4(blocks[0], scales[0], out=out), exact.bfloat16())
