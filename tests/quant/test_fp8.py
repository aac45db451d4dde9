"""FP8 weights with block scales: the float32 dequantization against transformers' own, and the native kernel (every
path: the same bits) against that dequantization."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.quant import QuantSpec, native
from sluice.quant import linear as linear_mod
from sluice.quant.compute import Compute
from sluice.quant.fp8 import dequantize_fp8, quantize_fp8
from sluice.quant.linear import QuantLinear, Scratch, StoredLinear
from sluice.quant.native import kernels

PATHS = (native.PORTABLE, native.AVX2, native.BEST)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def _weight(out: int, inp: int, block=(128, 128), scale_dtype=torch.float32, seed: int = 0):
    """(spec, raw stored bytes, codes, scales) of random weights quantized as the uploads are."""
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)) * 0.05
    codes, scales = quantize_fp8(w, block, scale_dtype)
    spec = QuantSpec.fp8(out, inp, block, scale_dtype)
    raw = torch.zeros(spec.nbytes, dtype=torch.uint8)
    for part, t in zip(spec.parts, (codes, scales)):
        raw[part.offset: part.offset + part.nbytes] = t.contiguous().view(torch.uint8).flatten()
    return spec, raw, codes, scales


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(256, 384), (64, 96), (128, 32), (3, 4, 256, 128)])
def test_dequantize_is_transformers_load_time_product_bitwise(shape, scale_dtype):
    """Every dimension a multiple of 128 or below it: transformers' Fp8Dequantize (what from_pretrained runs on a
    CPU) in float32, bit for bit; stacked experts [E, out, in] too."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    w = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    codes, scales = quantize_fp8(w, (128, 128), scale_dtype)
    want = Fp8Dequantize(None)._dequantize_one(codes, scales, output_dtype=torch.float32)
    assert torch.equal(_bits(dequantize_fp8(codes, scales, (128, 128))), _bits(want))


@pytest.mark.parametrize("shape,block", [((192, 160), (128, 128)), ((576, 224), (128, 128)), ((100, 96), (16, 32)),
                                         ((2, 300, 64), (128, 128))])
def test_partial_blocks_are_deepseek_blocks(shape, block):
    """Partial last blocks (DeepSeek-V3's kv_a_proj_with_mqa has 576 rows: 4.5 blocks) are indexed by the configured
    block, as DeepSeek's weight_dequant and transformers' _dequantize_fp8_weight do: bitwise the latter. (transformers'
    load-time Fp8Dequantize derives the block from the grid instead: 192 rows in 2 scale rows read as blocks of 96,
    and 576 rows in 5 refused.)"""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    w = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    codes, scales = quantize_fp8(w, block)
    got = dequantize_fp8(codes, scales, block)
    assert torch.equal(_bits(got), _bits(_dequantize_fp8_weight(codes, scales, list(block), torch.float32)))
    rows, cols = shape[-2:]
    for r, c in ((0, 0), (rows - 1, cols - 1), (rows // 2 + 1, cols - 33)):  # the last weight: a partial block's
        want = codes[..., r, c].float() * scales[..., r // block[0], c // block[1]].float()
        assert torch.equal(_bits(got[..., r, c]), _bits(want))


def test_quantize_round_trips_within_e4m3_precision():
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(3))
    w[:128, :128] = 0  # an all-zero block: scale 1, codes 0
    codes, scales = quantize_fp8(w)
    assert scales.shape == (3, 2) and scales[0, 0] == 1 and not codes[:128, :128].float().any()
    back = dequantize_fp8(codes, scales, (128, 128))
    # e4m3 keeps 3 mantissa bits: within 2^-4 of each value, or of the block's scale where it is subnormal
    bound = torch.maximum(w.abs() / 16, scales.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
                          * 2.0 ** -10)
    assert ((back - w).abs() <= bound).all()
    assert (codes.float().abs().amax() == 448)  # each block's largest value maps to e4m3's largest


@pytest.mark.parametrize("scale", [1.0, 0.0123, 2.0 ** 125, 2.0 ** -140])
@pytest.mark.parametrize("path", PATHS)
def test_all_256_codes_are_torchs_products(path, scale):
    """Codes 0x00-0xff (subnormals, -0, NaN at 0x7f / 0xff) times a scale: torch's float8_e4m3fn -> float32 times it,
    bit for bit; a scale whose 256 times overflows (2^125: the AVX2 path's scalar fallback) or is subnormal too."""
    spec = QuantSpec.fp8(8, 32, (128, 128))
    raw = torch.zeros(spec.nbytes, dtype=torch.uint8)
    raw[:256] = torch.arange(256, dtype=torch.uint8)
    raw[spec.parts[1].offset: spec.parts[1].offset + 4] = torch.tensor([scale]).view(torch.uint8)
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().view(8, 32) * torch.tensor(scale)
    assert torch.equal(_bits(kernels.dequantize(spec, raw, path=path)), _bits(want))
    assert torch.equal(_bits(spec.dequantize(raw)), _bits(want))
    # the T = 1 dot product's own decoding: codes of magnitude below 2 (finite times any scale here), x picking
    # column 3 of each row (the other products +-0)
    codes = (torch.arange(256) % 64 | torch.arange(256) & 0x80).to(torch.uint8)
    raw[:256] = codes
    x = torch.zeros(1, 32)
    x[0, 3] = 1.0
    want = codes.view(torch.float8_e4m3fn).float().view(8, 32)[:, 3] * torch.tensor(scale)
    assert torch.equal(_bits(kernels.linear(spec, x, raw, path=path)[0]), _bits(want + 0.0))


CASES = [  # out, in, block, scale dtype
    (256, 384, (128, 128), torch.float32),
    (300, 224, (128, 128), torch.bfloat16),  # partial blocks both ways
    (64, 96, (128, 128), torch.float16),  # one block larger than the weight
    (257, 96, (16, 32), torch.float32),  # small blocks: a scale per 32 inputs
]


@pytest.mark.parametrize("out,inp,block,scale_dtype", CASES)
def test_native_dequantize_is_the_reference_on_every_path(out, inp, block, scale_dtype):
    spec, raw, codes, scales = _weight(out, inp, block, scale_dtype)
    want = dequantize_fp8(codes, scales, block)
    assert torch.equal(_bits(spec.dequantize(raw)), _bits(want))
    for path in PATHS:
        assert torch.equal(_bits(kernels.dequantize(spec, raw, path=path)), _bits(want)), path
        bf16 = kernels.dequantize(spec, raw, torch.empty(out, inp, dtype=torch.bfloat16), path=path)
        assert torch.equal(_bits(bf16), _bits(want.bfloat16())), path


@pytest.mark.parametrize("out,inp,block,scale_dtype", CASES)
@pytest.mark.parametrize("T", [1, 2, 3, 4, 7])
def test_native_linear_is_the_same_bits_on_every_path(out, inp, block, scale_dtype, T):
    """y = x @ W^T from the FP8 bytes: the portable path dots in the AVX2 path's order (the same bits on both, and
    for T = 1, where AVX2 dots the weights without storing them), within float32 rounding of F.linear on the
    reference weights; a row range computes the same columns."""
    spec, raw, codes, scales = _weight(out, inp, block, scale_dtype)
    x = torch.randn(T, inp, generator=torch.Generator().manual_seed(T))
    ys = [kernels.linear(spec, x, raw, path=p) for p in PATHS]
    for y in ys[1:]:
        assert torch.equal(_bits(y), _bits(ys[0]))
    want = F.linear(x.double(), dequantize_fp8(codes, scales, block).double()).float()
    assert ((ys[0] - want).norm() / want.norm()).item() < 2e-6
    part = kernels.linear(spec, x, raw, torch.zeros(T, out), rows=(5, out - 3), path=native.PORTABLE)
    assert torch.equal(_bits(part[:, 5: out - 3]), _bits(ys[0][:, 5: out - 3]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ladder_computes_the_reference_at_every_row_count(dtype, monkeypatch):
    """StoredLinear / QuantLinear on FP8 bytes: the row kernel (T <= 32) and the many-rows path, whose blocks of
    rows start at whole blocks of the weight (here 2 blocks of 128 rows a scratch); QuantLinear keeps the bytes (no
    integer path) and its rows dequantize apart."""
    monkeypatch.setattr(linear_mod, "SCRATCH_BYTES", 4 * 256 * 224)
    spec, raw, codes, scales = _weight(300, 224, (128, 128), torch.bfloat16)
    w = dequantize_fp8(codes, scales, (128, 128))
    compute = Compute(dtype=dtype)
    lin = QuantLinear(spec, raw, compute)
    assert lin.nbytes == spec.nbytes < 300 * 224 * 2 and not lin.int8 and QuantLinear.group([lin, lin]) is None
    assert torch.equal(_bits(lin.dequantize((128, 300))), _bits(w[128:]))
    with pytest.raises(ValueError, match="block's first"):
        lin.dequantize((100, 300))
    for T in (1, 3, 32, 40):
        x = torch.randn(T, 224, generator=torch.Generator().manual_seed(T)).to(dtype)
        want = F.linear(x.double(), w.double())
        for y in (lin.linear(x), StoredLinear(spec, compute)(x, raw, Scratch())):
            assert y.dtype == dtype and y.shape == (T, 300)
            tol = 2e-6 if dtype is torch.float32 else 1e-2
            assert ((y.double() - want).norm() / want.norm()).item() < tol, T


@pytest.mark.parametrize("args", [dict(out_features=64, in_features=48), dict(out_features=64, in_features=64,
                                                                                block=(128, 48)),
                                  dict(out_features=64, in_features=64, scale_dtype=torch.uint8)])
def test_specs_the_kernels_cannot_take_are_value_errors(args):
    with pytest.raises(ValueError, match="whole groups of 32"):
        QuantSpec.fp8(**args)
