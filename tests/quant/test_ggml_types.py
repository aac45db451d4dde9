"""The 1-3 bit types of issue 32 (Q2_K, Q3_K, TQ1_0, TQ2_0 and the IQ types): bitwise gguf.quants.dequantize on
random blocks of several sizes, their grids and sign tables equal to gguf's, the GGUF reader and QuantSpec taking
them, and the projections' two routes: native kernels (tests/quant/test_q8_low.py), or without the extension the
torch dequantization and one GEMM."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")

from sluice.checkpoint.formats import BY_NAME, SUPPORTED  # noqa: E402
from sluice.checkpoint.gguf import read_gguf  # noqa: E402
from sluice.errors import CheckpointError  # noqa: E402
from sluice.quant import ggml, ggml_grids, native  # noqa: E402
from sluice.quant.compute import Compute  # noqa: E402
from sluice.quant.ggml_iq import grid, sign_rows  # noqa: E402
from sluice.quant.linear import Scratch, StoredLinear  # noqa: E402
from sluice.quant.spec import QuantSpec  # noqa: E402
from sluice.quant.tensor import read_tensor  # noqa: E402
from tests.checkpoint.gguf_files import Q, encode  # noqa: E402
from tests.quant.samples import F16_FIELDS, random_stored, read_f16, write_f16  # noqa: E402
from tests.quant.test_dequant import random_blocks, reference, same_bits  # noqa: E402

NEW = ["Q2_K", "Q3_K", "TQ1_0", "TQ2_0", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
       "IQ4_NL", "IQ4_XS"]
GRID_TYPES = ["IQ1_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("rows,blocks", [(1, 1), (5, 1), (5, 2), (3, 7)])
def test_new_types_match_gguf_bitwise(name, rows, blocks):
    """One block alone too: its u32 fields at offsets that are not multiples of 4 (IQ3_XXS's at 66) need a copy
    before a wider view."""
    raw = random_blocks(name, rows=rows, blocks_per_row=blocks, seed=blocks)
    got = ggml.dequantize(torch.from_numpy(raw), name).numpy()
    assert got.shape == (rows, blocks * BY_NAME[name].block_elems)
    assert same_bits(got, reference(raw, name))


@pytest.mark.parametrize("name", NEW)
def test_every_byte_value_in_every_position_matches_gguf(name):
    """256 blocks whose byte p of block k is (k + 7p) mod 256, the f16 scales kept finite: every position holds
    every byte value once (grid indices, sign indices and patterns, scale and high-bit fields), which random
    blocks of a few rows cannot promise."""
    f = BY_NAME[name]
    raw = random_blocks(name, rows=64, blocks_per_row=4, seed=7)
    b = raw.reshape(256, f.block_bytes)
    scales = [read_f16(b, name, at) for at in F16_FIELDS[name]]
    b[...] = (np.arange(256)[:, None] + 7 * np.arange(f.block_bytes)) % 256
    for at, v in zip(F16_FIELDS[name], scales):
        write_f16(b, name, at, v)
    got = ggml.dequantize(torch.from_numpy(raw), name).numpy()
    assert np.isfinite(got).all() and same_bits(got, reference(raw, name))


@pytest.mark.parametrize("name", GRID_TYPES)
def test_grids_are_ggufs(name):
    cls = getattr(gguf.quants, name)
    cls.init_grid()
    want = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
    got = grid(name)
    assert got.dtype == torch.int8 and tuple(got.shape) == cls.grid_shape
    assert np.array_equal(got.numpy().astype(np.float32), want)


def test_sign_rows_and_iq4_values_are_ggufs():
    ksigns = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8)  # [128] sign bit masks
    want = np.where((ksigns[:, None] >> np.arange(8)) & 1, -1, 1)
    assert np.array_equal(sign_rows().numpy(), want)
    assert ggml_grids.IQ4_NL_VALUES == tuple(gguf.quants.IQ4_NL.kvalues)


def test_the_grids_module_is_what_its_script_writes():
    """sluice/quant/ggml_grids.py is scripts/ggml_grids.py's output for the installed gguf (rerun it if not)."""
    spec = importlib.util.spec_from_file_location("ggml_grids_script", ROOT / "scripts" / "ggml_grids.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.module() == (ROOT / "sluice" / "quant" / "ggml_grids.py").read_text()


def test_supported_is_what_dequantize_computes():
    assert SUPPORTED == ggml.DEQUANTIZABLE
    assert set(NEW) | {"MXFP4"} <= SUPPORTED


@pytest.mark.parametrize("name", NEW)
def test_scales_without_codes(name):
    raw = torch.from_numpy(random_blocks(name, rows=3, blocks_per_row=2, seed=4))
    a, full = ggml.affine(raw, name, codes=False), ggml.affine(raw, name)
    assert a.codes is None and torch.equal(a.scale, full.scale) and a.group == full.group
    assert full.codes.dtype in (torch.int8, torch.uint8) and full.codes.shape == (3, 2 * BY_NAME[name].block_elems)


@pytest.mark.parametrize("name", NEW)
def test_projections_run_native_kernels_or_the_torch_dequantization(name, monkeypatch):
    """With the extension the native kernels compute these types (issue 32 item 2; their bits in
    tests/quant/test_q8_low.py); without it a projection dequantizes its stored bytes (bitwise gguf) and multiplies
    them in float32 at every row count and compute dtype."""
    from sluice.quant.native import _lib

    spec = QuantSpec.ggml(name, 16, 512)
    raw = random_stored(spec, seed=2)
    w = torch.from_numpy(reference(raw.view(16, -1).numpy(), name))  # [16, 512]
    assert torch.equal(spec.dequantize(raw), w)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0))
    if native.native_available():
        assert native.supports(spec) and native.q8_supported(spec) and StoredLinear(spec, Compute()).native
    monkeypatch.setattr(_lib, "LIB", None)  # as after an install without a C compiler
    for dtype in (torch.float32, torch.bfloat16):
        lin = StoredLinear(spec, Compute(dtype=dtype))
        assert not lin.native
        for rows in (1, 5):
            got = lin(x[:rows].to(dtype), raw, Scratch())
            assert torch.equal(got, F.linear(x[:rows].to(dtype).float(), w).to(dtype))


def test_the_gguf_reader_reads_every_new_type(tmp_path):
    """Tensors of every new type and of GGUF's MXFP4 written by the `gguf` package's writer: read with their
    shapes and byte counts, and read_tensor gives bitwise gguf's dequantization."""
    w = gguf.GGUFWriter(tmp_path / "m.gguf", "qwen3moe")
    blocks = {}
    for i, name in enumerate(NEW + ["MXFP4"]):
        values = np.random.default_rng(i).standard_normal((3, 512)).astype(np.float32)
        blocks[name] = encode(values, Q[name], seed=i)  # random valid blocks, or gguf's own quantization
        w.add_tensor(f"w.{name}", blocks[name], raw_dtype=Q[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    refs = read_gguf(tmp_path / "m.gguf").tensors
    for name, raw in blocks.items():
        ref = refs[f"w.{name}"]
        assert (ref.dtype, ref.shape, ref.nbytes) == (name, (3, 512), raw.nbytes)
        assert same_bits(read_tensor(ref).numpy(), reference(raw, name))


def test_an_unsupported_type_in_a_file_is_one_line_naming_tensor_and_type(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "m.gguf", "qwen3moe")
    w.add_tensor("blk.0.ffn_down_exps.weight", np.zeros((2, 292), np.uint8), raw_dtype=Q.Q8_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError) as e:
        read_gguf(tmp_path / "m.gguf")
    msg = str(e.value)
    assert "\n" not in msg and "blk.0.ffn_down_exps.weight" in msg and "Q8_K is not supported" in msg
