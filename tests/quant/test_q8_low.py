"""The low-bit GGUF types natively (issue 32 item 2): their dequantization in C (lowbit.c, bitwise gguf's, into
float32 or rounded to bf16 for a prompt's bf16 GEMM) and their integer kernels (q8_low.c, q8_iq.h: x coded to 8-bit
planes, integer dots), on every C path with the same bits, for any T and any thread count.

Accuracy of the integer path, written down here: relative L2 of y against F.linear on the exactly dequantized
weights (SPECS, random blocks; Gaussian x: T = 1, 3, 5; heavy-tailed x: 4 rows, seed 7; every type within the range):
                                   planes=1 (llama.cpp's)   planes=2 (the default)
  Gaussian x                       4.7e-3 - 9.6e-3          1.7e-5 - 3.7e-5
  heavy-tailed x                   1.1e-2 - 2.4e-2          3.9e-5 - 8.8e-5
(largest: Q2_K with one plane, IQ3_S with two; the 256-value types read x in super-blocks, one scale per 256 values,
as q8.c's K-quants do: Q4_K on the same heavy-tailed x is 7.1e-5 with two planes.) The bounds: planes=1 1.5e-2 /
3e-2, planes=2 1e-4 (tests/quant/test_q8.py's for two planes).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")

from sluice.checkpoint.formats import BY_NAME  # noqa: E402
from sluice.quant import native  # noqa: E402
from sluice.quant.compute import Compute  # noqa: E402
from sluice.quant.ggml_iq import grid  # noqa: E402
from sluice.quant.linear import BF16_GEMM_MIN_ROWS, NATIVE_MAX_ROWS, Q8_MAX_ROWS, Scratch, StoredLinear  # noqa: E402
from sluice.quant.native import pool  # noqa: E402
from sluice.quant.native._lib import LIB  # noqa: E402
from sluice.quant.spec import QuantSpec  # noqa: E402
from tests.quant import paths  # noqa: E402
from tests.quant.samples import F16_FIELDS, random_expert_slots, random_stored, read_f16, write_f16  # noqa: E402
from tests.quant.test_dequant import random_blocks, reference, same_bits  # noqa: E402

pytestmark = pytest.mark.skipif(not native.native_available(),
                                reason="native kernels not built (pip install -e . with a C compiler builds them)")

NEW = ["Q2_K", "Q3_K", "TQ1_0", "TQ2_0", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
       "IQ1_S", "IQ1_M"]
LOW = NEW + ["MXFP4"]  # GGUF's MXFP4 had the float kernel; it joins the integer path here
# odd row counts, odd block counts (256-value types: 3 blocks; IQ4_NL / MXFP4: 7 blocks of 32)
SPECS = [QuantSpec.ggml(n, 37, 224 if BY_NAME[n].block_elems == 32 else 768) for n in LOW]
ROOT = Path(__file__).resolve().parents[2]


def rel_l2(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = F.linear(x.double(), w.double())
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("name", NEW)
def test_native_dequantization_is_ggufs_bitwise(name):
    """Random blocks with edge-case f16 scales (zeros, subnormals, the largest finite), all-0x00 / all-0xFF blocks,
    and blocks holding every byte value in every position: float32 on every path is gguf.quants.dequantize's bits,
    bf16 those values rounded once."""
    f = BY_NAME[name]
    edges = random_blocks(name, rows=6, blocks_per_row=9, seed=1)
    every = random_blocks(name, rows=64, blocks_per_row=4, seed=7)  # 256 blocks: byte p of block k is k + 7p
    b = every.reshape(256, f.block_bytes)
    scales = [read_f16(b, name, at) for at in F16_FIELDS[name]]
    b[...] = (np.arange(256)[:, None] + 7 * np.arange(f.block_bytes)) % 256
    for at, v in zip(F16_FIELDS[name], scales):
        write_f16(b, name, at, v)
    for raw in (edges, every):
        want = reference(raw, name)
        spec = QuantSpec.ggml(name, raw.shape[0], raw.shape[1] // f.block_bytes * f.block_elems)
        stored = torch.from_numpy(raw.reshape(-1).copy())
        for got in paths.on_each(lambda path: native.dequantize(spec, stored, path=path)):
            assert same_bits(got.numpy(), want)
        bf16 = paths.on_each(lambda path: native.dequantize(spec, stored, torch.empty(want.shape, dtype=torch.bfloat16),
                                                            path=path))
        assert torch.equal(bf16[0].view(torch.int16), torch.from_numpy(want).to(torch.bfloat16).view(torch.int16))
        paths.same_bits(bf16)


@pytest.mark.parametrize("name", ["IQ1_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"])
def test_the_c_grids_are_ggml_iq_grids(name):
    """Every row lowbit.c decoded from iq_grids.h equals sluice.quant.ggml_iq.grid's (gguf's, test_ggml_types.py);
    IQ1_S is kept times 8 (its codes are 8 * grid +- 1)."""
    import ctypes

    LIB.sluice_lowbit_grid_row.argtypes = [ctypes.c_int, ctypes.c_int]
    LIB.sluice_lowbit_grid_row.restype = ctypes.c_uint64
    g = grid(name) * (8 if name == "IQ1_S" else 1)  # int8 [rows, width]
    index = ["IQ1_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"].index(name)  # iq_grids.h GRID_*
    rows = [LIB.sluice_lowbit_grid_row(index, r) for r in range(g.shape[0])]
    got = torch.tensor(np.array(rows, dtype=np.uint64).view(np.int8).reshape(-1, 8)[:, : g.shape[1]])
    assert torch.equal(got, g)


def test_the_grids_header_is_what_its_script_writes():
    """sluice/quant/native/iq_grids.h is scripts/iq_grids_c.py's output for sluice/quant/ggml_grids.py."""
    spec = importlib.util.spec_from_file_location("iq_grids_c", ROOT / "scripts" / "iq_grids_c.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.header() == (ROOT / "sluice" / "quant" / "native" / "iq_grids.h").read_text()


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("T", [1, 3, 5])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_integer_path_within_the_bound_and_the_same_bits_on_every_path(spec, T, planes):
    assert native.q8_supported(spec)
    raw = random_stored(spec, seed=T)
    x = torch.randn(T, spec.in_features, generator=torch.Generator().manual_seed(T))
    ys = paths.on_each(lambda path: native.linear_q8(spec, x, raw, planes=planes, path=path))
    assert ys[0].shape == (T, spec.out_features) and ys[0].dtype == torch.float32
    assert rel_l2(ys[0], x, spec.dequantize(raw)) <= (1.5e-2 if planes == 1 else 1e-4)
    for t in range(T):  # row t does not depend on T (1 .. 4 x rows per kernel call)
        assert torch.equal(native.linear_q8(spec, x[t:t + 1].contiguous(), raw, planes=planes), ys[0][t:t + 1])
    xq = native.quantize_q8(x, planes, spec=spec)  # the layout this type reads: super-blocks or 32-value blocks
    assert xq.shape[1] == native.q8_row_bytes(spec.in_features, planes, spec)
    assert torch.equal(native.linear_q8(spec, x, raw, xq=xq, planes=planes), ys[0])
    paths.same_bits(ys)


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_heavy_tailed_activations_stay_within_the_bound(spec, planes):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, spec.in_features, generator=g) * torch.exp(torch.randn(spec.in_features, generator=g))
    raw = random_stored(spec, seed=7)
    y = native.linear_q8(spec, x, raw, planes=planes)
    assert rel_l2(y, x, spec.dequantize(raw)) <= (3e-2 if planes == 1 else 1e-4)


@pytest.mark.parametrize("name", ["TQ1_0", "TQ2_0", "MXFP4"])
def test_weights_the_gguf_package_quantized(name):
    """The types gguf.quants can write, from Gaussian weights (its own encoding instead of random blocks): the
    integer path within the two-plane bound, every path the same bits, and the native dequantization its bits."""
    w = np.random.default_rng(5).standard_normal((40, 512)).astype(np.float32) * 0.02
    raw = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType[name]).reshape(-1).copy())
    spec = QuantSpec.ggml(name, 40, 512)
    exact = torch.from_numpy(reference(raw.numpy().reshape(40, -1), name))
    assert torch.equal(native.dequantize(spec, raw), exact)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(5))
    ys = paths.on_each(lambda path: native.linear_q8(spec, x, raw, path=path))
    assert rel_l2(ys[0], x, exact) <= 1e-4
    paths.same_bits(ys)


def _extreme(name: str, raw: torch.Tensor, spec: QuantSpec) -> None:
    """Every integer scale / min / offset term of the blocks at its largest magnitude (in place)."""
    f = BY_NAME[name]
    b = raw.view(spec.out_features, -1, f.block_bytes)
    if name == "Q2_K":
        b[..., 0:16] = 255  # scales and mins 15
        b[..., 16:80] = 255  # codes 3
    elif name == "Q3_K":
        b[..., 96:108] = 0  # every 6-bit scale 0: -32
        b[..., 0:32] = 255  # high bits set: codes up to 7 - 4
    elif name == "IQ4_XS":
        b[..., 2:8] = 0  # s = 0: scale -32
        b[..., 8:136] = 0  # every code kvalues[0] = -127
    elif name in ("IQ2_XXS", "IQ3_XXS"):
        b[..., 2:66 if name == "IQ2_XXS" else 98] = 255  # the largest grid rows, s = 15


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "IQ4_XS", "IQ2_XXS", "IQ3_XXS"])
def test_the_largest_integer_terms_are_exact_on_every_path(name, planes):
    """Scales, mins and codes at their extremes against x at its largest codes (all +-1: every code 127): the
    int16 maddubs pairs, the int32 lanes and Q2_K / Q3_K's min / offset products (two per float lane) stay exact,
    so every path gives the same bits and the exact weights' result."""
    spec = QuantSpec.ggml(name, 8, 1024)
    raw = random_stored(spec, seed=3)
    _extreme(name, raw, spec)
    w = spec.dequantize(raw)
    every = []
    for x in (torch.ones(2, 1024), -torch.ones(2, 1024)):
        every.append(paths.on_each(lambda path: native.linear_q8(spec, x, raw, planes=planes, path=path)))
        assert rel_l2(every[-1][0], x, w) <= (1.5e-2 if planes == 1 else 1e-4)
    for ys in every:
        paths.same_bits(ys)


@pytest.mark.parametrize("T", [1, 3, 17, 64])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_the_float_row_kernel_matches_the_exact_weights(spec, T):
    """kernels.c's float path on these types (T <= NATIVE_MAX_ROWS at bf16, every T at float32): each row
    dequantized exactly, float32 dots; within float32 dot-product error of the exact weights."""
    raw = random_stored(spec, seed=T)
    x = torch.randn(T, spec.in_features, generator=torch.Generator().manual_seed(T))
    ref = F.linear(x.double(), spec.dequantize(raw).double())
    for y in paths.on_each(lambda path: native.linear(spec, x, raw, path=path)):
        assert float((y.double() - ref).norm() / ref.norm()) <= 1e-5


@pytest.fixture
def c_threads():
    """pool.set_threads(n) for the test (the C pool), back to one thread after it."""
    yield pool.set_threads
    pool.set_threads(1)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("T", [1, 2])
def test_linears_q8_of_mixed_low_types_are_linear_q8_on_any_thread_count(T, threads, c_threads):
    """Several projections of one x in one call (x coded once per layout: super-blocks and 32-value blocks here),
    rows over the C pool: each y is linear_q8's, bitwise, on every path; bf16 outputs rounded in C."""
    c_threads(threads)
    specs = [QuantSpec.ggml(n, rows, 512) for n, rows in (("IQ2_XXS", 300), ("Q3_K", 3), ("IQ4_NL", 129),
                                                          ("IQ3_S", 64), ("MXFP4", 40), ("Q4_K", 33))]
    raws = [random_stored(s, seed=k) for k, s in enumerate(specs)]
    x = torch.randn(T, 512, generator=torch.Generator().manual_seed(T))
    call = native.LinearsQ8(list(zip(specs, raws)))
    for planes in (1, 2):
        outs = paths.on_each(lambda path: call(x, planes=planes, path=path))
        for y, s, r in zip(outs[0], specs, raws):
            assert torch.equal(y, native.linear_q8(s, x, r, planes=planes))
        bf16 = call(x, planes=planes, out_dtype=torch.bfloat16)
        assert all(torch.equal(b, y.to(torch.bfloat16)) for b, y in zip(bf16, outs[0]))
        paths.same_bits(outs)


MIXED = [("IQ2_XXS", "IQ2_XXS", "IQ3_XXS"),  # an unsloth-style IQ2 mix: gate / up IQ2_XXS, down a bit wider
         ("IQ3_S", "Q2_K", "IQ4_NL"),  # three layouts in one expert: super-blocks for gate / up, 32-value for down
         ("TQ1_0", "IQ1_M", "Q3_K")]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("kinds", MIXED, ids="-".join)
def test_a_layer_of_mixed_low_types_in_one_call(kinds, T, threads, c_threads):
    """ExpertCall on experts of low-bit types (gate, up, down of different types): expert_q8 is the three
    projections' linear_q8 with silu in float32 between them and within the two-plane bound of the exact float64
    expert; ExpertCall.many over several experts, rows split over the C pool, gives each one's bits on every path
    and thread count."""
    from sluice.store.layout import ExpertFormat

    c_threads(threads)
    H, I = 512, 256
    specs = (QuantSpec.ggml(kinds[0], I, H), QuantSpec.ggml(kinds[1], I, H), QuantSpec.ggml(kinds[2], H, I))
    fmt = ExpertFormat.of(*specs)
    slots = random_expert_slots(fmt, 4, seed=T)
    call = native.ExpertCall(specs, (0, fmt.up_offset, fmt.down_offset))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    parts = [(slots[0, :fmt.gate.nbytes], slots[0, fmt.up_offset:fmt.up_offset + fmt.up.nbytes],
              slots[0, fmt.down_offset:fmt.down_offset + fmt.down.nbytes])]
    one = native.expert_q8(specs, parts[0], x)
    g, u = (native.linear_q8(s, x, r) for s, r in zip(specs[:2], parts[0][:2]))
    want = native.linear_q8(specs[2], (g / (1 + torch.exp(-g)) * u).contiguous(), parts[0][2])
    assert float((one - want).norm() / want.norm()) <= 1e-5  # silu: libm's expf there, torch's exp here
    w = [s.dequantize(r).double() for s, r in zip(specs, parts[0])]
    exact = F.linear(F.silu(F.linear(x.double(), w[0])) * F.linear(x.double(), w[1]), w[2])
    assert float((one.double() - exact).norm() / exact.norm()) <= 1e-4
    each = torch.empty(4, T, H)
    for e in range(4):
        call(slots[e], x, each[e])
    assert torch.equal(each[0], one)

    def run(path):
        ys = torch.full((5, T, H), float("nan"))
        call.many(slots, [2, 0, 3, 1], x, ys, [3, 1, 4, 2], path=path)  # expert e into row e + 1
        return ys[1:]
    outs = paths.on_each(run)
    assert torch.equal(outs[0], each)
    paths.same_bits(outs)


@pytest.mark.parametrize("name", ["Q3_K", "IQ2_XXS", "IQ4_NL"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_stored_linear_takes_the_native_ladder(name, dtype):
    """A projection of a low-bit type runs the ladder of every native format (quant/linear.py): the integer path up
    to Q8_MAX_ROWS at bf16, the float row kernel to NATIVE_MAX_ROWS, then the exact weights dequantized natively
    and a float32 GEMM; with bf16 GEMMs (a prompt) the weights dequantized to bf16 and torch's bf16 GEMM."""
    spec = QuantSpec.ggml(name, 40, 512)
    raw = random_stored(spec, seed=4)
    w = spec.dequantize(raw)
    lin = StoredLinear(spec, Compute(dtype))
    assert lin.native and lin.int8 == (dtype is torch.bfloat16)
    for T in (1, Q8_MAX_ROWS, Q8_MAX_ROWS + 1, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1):
        x = torch.randn(T, 512, generator=torch.Generator().manual_seed(T)).to(dtype)
        if T > NATIVE_MAX_ROWS:
            want = F.linear(x.float(), w)
        elif T > Q8_MAX_ROWS or dtype is torch.float32:
            want = native.linear(spec, x.float(), raw)
        else:
            want = native.linear_q8(spec, x.float(), raw)
        assert torch.equal(lin(x, raw, Scratch()), want.to(dtype)), T
    gemm = StoredLinear(spec, Compute(torch.bfloat16, bf16_gemm=True))
    x = torch.randn(BF16_GEMM_MIN_ROWS + 5, 512, generator=torch.Generator().manual_seed(9)).bfloat16()
    assert torch.equal(gemm(x, raw, Scratch()), F.linear(x, w.to(torch.bfloat16)))


def test_types_without_kernels_stay_a_clean_error():
    """A ggml type sluice reads but computes no kernel for (plain BF16) and MLX keep their ValueError; a type it
    does not read at all is UnsupportedFormat naming it (checkpoint errors add the tensor: test_ggml_types.py)."""
    from sluice.checkpoint.formats import UnsupportedFormat

    x = torch.randn(2, 256)
    plain = QuantSpec.ggml("BF16", 8, 256)
    assert not native.q8_supported(plain) and not native.q8_supported(QuantSpec.mlx(4, 64, 8, 256))
    with pytest.raises(ValueError, match="int8 path does not compute ggml BF16"):
        native.linear_q8(plain, x, random_stored(plain))
    with pytest.raises(UnsupportedFormat, match="Q8_K"):
        QuantSpec.ggml("Q8_K", 8, 256)
