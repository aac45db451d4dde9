"""ggml block dequantization: bitwise equal to gguf.quants.dequantize on random and edge-case blocks, every type."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from sluice.checkpoint.formats import BY_NAME, UnsupportedFormat  # noqa: E402
from sluice.quant.ggml import DEQUANTIZABLE, dequantize  # noqa: E402
from tests.quant.samples import F16_FIELDS, read_f16, write_f16  # noqa: E402

QUANTIZED = sorted(DEQUANTIZABLE - {"F32", "F16", "BF16"})
# f16 edge values: +-0, smallest subnormal, largest subnormal, smallest normal, 1, -1, largest finite, -largest
EDGE_F16 = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF], dtype=np.uint16)


def random_blocks(name: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random bytes with finite f16 scales; the first blocks of every row carry edge scales, and a few blocks have
    all code bytes 0x00 or 0xFF (extreme nibbles / bits)."""
    f = BY_NAME[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, blocks_per_row * f.block_bytes), dtype=np.uint8)
    b = raw.reshape(rows, blocks_per_row, f.block_bytes)
    b[0, 0, :] = 0x00
    b[-1, -1, :] = 0xFF
    for at in F16_FIELDS.get(name, ()):
        v = read_f16(b, name, at)  # [rows, blocks]
        v[(v & 0x7C00) == 0x7C00] &= 0xBFFF  # no inf / nan scales
        edge = np.resize(EDGE_F16, v.shape[1])
        v[1:, :] = np.where(rng.random(v[1:].shape) < 0.3, np.resize(edge, v[1:].shape), v[1:])
        write_f16(b, name, at, v)
    if name == "MXFP4":
        b[0, :, 0] = np.resize(np.array([0, 1, 2, 127, 254, 255], dtype=np.uint8), blocks_per_row)
    return raw


def reference(raw: np.ndarray, name: str) -> np.ndarray:
    with np.errstate(over="ignore"):  # gguf's MXFP4 at e=255 overflows to inf, as ours does
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("seed", [0, 1])
def test_quantized_types_match_gguf_bitwise(name, seed):
    raw = random_blocks(name, rows=6, blocks_per_row=9, seed=seed)
    got = dequantize(torch.from_numpy(raw), name).numpy()
    assert same_bits(got, reference(raw, name))


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_plain_types_match_gguf_bitwise(name):
    rng = np.random.default_rng(3)
    f = BY_NAME[name]
    raw = rng.integers(0, 256, (5, 40 * f.block_bytes), dtype=np.uint8)
    if name == "F16":  # finite values plus +-inf and -0 (f16 -> f32 NaN payloads are the CPU's business)
        v = raw.view(np.uint16)
        v[(v & 0x7C00) == 0x7C00] &= 0xBFFF
        v[0, :3] = [0x7C00, 0xFC00, 0x8000]
    if name == "BF16":  # includes NaNs and infs: a 16-bit shift keeps every bit
        raw.view(np.uint16)[0, :4] = [0x7F80, 0xFF80, 0x7FC1, 0x8000]
    got = dequantize(torch.from_numpy(raw), name).numpy()
    assert same_bits(got, reference(raw, name))


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "Q6_K", "BF16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_out_receives_the_float32_values_rounded_once(name, dtype):
    raw = random_blocks(name, rows=4, blocks_per_row=2, seed=5)
    want = torch.from_numpy(reference(raw, name)).to(dtype)
    out = torch.full(want.shape, 7.0, dtype=dtype)
    got = dequantize(torch.from_numpy(raw), name, out=out)
    assert got is out and torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                      want.view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_flat_bytes_with_a_shape():
    raw = random_blocks("Q4_0", rows=6, blocks_per_row=2, seed=2)  # 6 rows of 64 values = [2, 3, 64]
    got = dequantize(torch.from_numpy(raw).reshape(-1), "Q4_0", (2, 3, 64))
    assert got.shape == (2, 3, 64)
    assert same_bits(got.numpy(), reference(raw, "Q4_0").reshape(2, 3, 64))


def test_unknown_and_unsupported_types_are_named():
    raw = torch.zeros(3, 292, dtype=torch.uint8)
    with pytest.raises(UnsupportedFormat, match="Q8_K") as err:  # ggml's activation type: never a weight's
        dequantize(raw, "Q8_K")
    assert err.value.format == "Q8_K" and isinstance(err.value, ValueError)
    with pytest.raises(UnsupportedFormat, match="Q9_Z"):
        dequantize(raw, "Q9_Z")


def test_bad_sizes_and_dtypes_are_value_errors():
    with pytest.raises(ValueError, match="Q4_0 rows"):
        dequantize(torch.zeros(2, 17, dtype=torch.uint8), "Q4_0")
    with pytest.raises(ValueError, match="take 36 bytes"):
        dequantize(torch.zeros(35, dtype=torch.uint8), "Q4_0", (2, 32))
    with pytest.raises(ValueError, match="whole blocks"):
        dequantize(torch.zeros(18, dtype=torch.uint8), "Q4_0", (1, 16))
    with pytest.raises(ValueError, match="uint8"):
        dequantize(torch.zeros(2, 18, dtype=torch.int8), "Q4_0")
    with pytest.raises(ValueError, match="out must be"):
        dequantize(torch.zeros(2, 18, dtype=torch.uint8), "Q4_0", out=torch.empty(2, 31))
