"""The native kernels (sluice/quant/native) against the exact dequantization + a float64 matmul, on each C path
(tests/quant/paths.py: the best this CPU runs, AVX2 alone, the portable one)."""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from sluice.quant import native
from sluice.quant.spec import QuantSpec
from sluice.quant.compute import Compute
from sluice.quant.linear import BF16_GEMM_MIN_ROWS, NATIVE_MAX_ROWS, QuantLinear, Scratch, StoredLinear
from sluice.quant.native import PORTABLE, _lib, pool, prompt
from tests.quant.samples import random_stored
from tests.quant import paths

built = pytest.mark.skipif(not native.native_available(),
                           reason="native kernels not built (pip install -e . with a C compiler builds them)")

GGML = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"]
# odd row counts; rows of whole blocks (256 for the K-quants, 32 for the rest) and odd block counts
SPECS = [QuantSpec.ggml(n, 37, 768 if n.endswith("K") else 224) for n in GGML]
SPECS += [QuantSpec.mlx(bits, group, 29, 384, dt) for bits, group, dt in
          [(4, 32, torch.bfloat16), (4, 64, torch.float16), (4, 128, torch.float32), (8, 32, torch.float16),
           (8, 64, torch.bfloat16), (8, 128, torch.float32)]]
SPECS += [QuantSpec.mxfp4(29, 224)]  # gpt-oss layout


@pytest.fixture(params=paths.PATHS)
def path(request):
    """The `path` argument of the wrappers: each C path this CPU runs."""
    return paths.code(request.param)


def _ids(s: QuantSpec) -> str:
    return f"{s.name}-g{s.group_size}-{str(s.scale_dtype).split('.')[-1]}" if s.family == "mlx" else s.name


def check_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y within float32 dot-product error of x @ w^T (computed in float64): relative L2 <= 1e-5, and every element
    within K * 2^-24 * (|x| @ |w|^T), the bound of a float32 sum of K products."""
    ref = F.linear(x.double(), w.double())
    assert float((y.double() - ref).norm() / ref.norm()) <= 1e-5
    bound = F.linear(x.double().abs(), w.double().abs()) * x.shape[1] * 2.0 ** -24
    assert bool(((y.double() - ref).abs() <= bound).all())


@built
@pytest.mark.parametrize("spec", SPECS, ids=_ids)
def test_dequantize_is_the_reference_bitwise(spec, path):
    raw = random_stored(spec, seed=3)
    assert torch.equal(native.dequantize(spec, raw, path=path), spec.dequantize(raw))


@built
@pytest.mark.parametrize("spec", SPECS, ids=_ids)
def test_dequantize_to_bf16_is_the_reference_rounded(spec, path):
    raw = random_stored(spec, seed=5)
    want = spec.dequantize(raw).to(torch.bfloat16)
    got = native.dequantize(spec, raw, torch.empty(spec.out_features * spec.in_features, dtype=torch.bfloat16),
                            path=path)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@built
@pytest.mark.parametrize("mode", ["bf16", "float32"])
def test_many_bf16_rows_follow_the_matmul_mode(mode):
    """From BF16_GEMM_MIN_ROWS rows, a model on bf16 GEMMs (Compute.bf16_gemm: --matmul bf16) runs the weights
    rounded to bf16 through torch's bf16 GEMM (an expert's StoredLinear and a resident QuantLinear alike); float32
    keeps the float32 dequantization + GEMM (a resident Q4_K weight: the AVX2 integer tiles where they run)."""
    spec = QuantSpec.ggml("Q4_K", 40, 512)
    raw = random_stored(spec, seed=6)
    w = spec.dequantize(raw)
    compute = Compute(torch.bfloat16, bf16_gemm=mode == "bf16")
    k = StoredLinear(spec, compute)
    ql = QuantLinear(spec, raw, compute)
    for T in (BF16_GEMM_MIN_ROWS - 1, BF16_GEMM_MIN_ROWS, 64):
        x = torch.randn(T, 512, generator=torch.Generator().manual_seed(T)).bfloat16()
        y = k(x, raw, Scratch())
        if T >= BF16_GEMM_MIN_ROWS and mode == "bf16":
            want = F.linear(x, w.to(torch.bfloat16))
        elif T > NATIVE_MAX_ROWS:
            want = F.linear(x.float(), w).to(torch.bfloat16)
        else:
            want = native.linear(spec, x.float(), raw).to(torch.bfloat16)
        assert torch.equal(y, want), (T, mode)
        if T >= BF16_GEMM_MIN_ROWS and compute.prompt_planes:
            # float32 GEMMs: a resident Q4_K weight's prompt rows take the integer tiles (test_prompt_avx2.py)
            tiles = torch.empty(T, 40)
            prompt.linears([(spec, raw, tiles)], x, planes=compute.prompt_planes)
            assert torch.equal(ql.linear(x), tiles.to(torch.bfloat16)), (T, mode)
        else:
            assert torch.equal(ql.linear(x), want), (T, mode)  # one ladder: the same calls
        assert ((y.float() - F.linear(x.double(), w.double()).float()).norm() / y.float().norm()) < 1e-2


@built
@pytest.mark.parametrize("T", [1, 3, 17, 64])
@pytest.mark.parametrize("spec", SPECS, ids=_ids)
def test_linear_matches_the_exact_weights(spec, T, path):
    raw = random_stored(spec, seed=T)
    x = torch.randn(T, spec.in_features, generator=torch.Generator().manual_seed(T))
    y = native.linear(spec, x, raw, path=path)
    assert y.shape == (T, spec.out_features) and y.dtype == torch.float32
    check_close(y, x, spec.dequantize(raw))
    # row t does not depend on T: each output is one dot product whose order depends on in_features only
    assert torch.equal(native.linear(spec, x[T // 2:T // 2 + 1].contiguous(), raw, path=path), y[T // 2:T // 2 + 1])
    # and every path gives the same bits (the portable dot fuses each multiply-add and reduces as the AVX2 one does:
    # a prompt through this kernel gave other logits at --isa portable than at --isa avx2 before)
    assert torch.equal(native.linear(spec, x, raw, path=PORTABLE), y)


@built
def test_a_wrong_weight_is_caught():
    spec = SPECS[GGML.index("Q4_K")]
    raw = random_stored(spec, seed=1)
    x = torch.randn(3, spec.in_features)
    w = spec.dequantize(raw)
    w[5, 100] += 0.05 * w.abs().max()  # a one-code error in a 4-bit weight is ~1/15 of its row's range
    with pytest.raises(AssertionError):
        check_close(native.linear(spec, x, raw), x, w)


@built
def test_repeated_threaded_and_split_calls_are_bitwise_identical():
    spec = QuantSpec.ggml("Q6_K", 301, 512)
    raw = random_stored(spec, seed=2)
    x = torch.randn(5, 512)
    y = native.linear(spec, x, raw)
    with ThreadPoolExecutor(3) as ex:  # the kernels keep no state: calls on several Python threads at once
        ys = list(ex.map(lambda _: native.linear(spec, x, raw), range(12)))
    assert all(torch.equal(y, z) for z in ys)
    pool.set_threads(3)  # output rows split over the C pool's 3 threads
    try:
        assert torch.equal(native.linear(spec, x, raw), y)
    finally:
        pool.set_threads(1)
    part = torch.zeros(5, 301)
    native.linear(spec, x, raw, out=part, rows=(100, 200))
    assert torch.equal(part[:, 100:200], y[:, 100:200]) and not part[:, :100].any() and not part[:, 200:].any()


@built
def test_bad_inputs_raise_value_errors():
    spec = QuantSpec.ggml("Q4_K", 8, 256)
    raw = random_stored(spec)
    x = torch.randn(2, 256)
    bad = [
        (x.double(), raw, None, None, "x must be a contiguous CPU torch.float32"),
        (torch.randn(256, 2).t(), raw, None, None, "x must be a contiguous"),
        (torch.randn(2, 255), raw, None, None, "x must be"),
        (torch.randn(256), raw, None, None, "x must be"),
        (x, raw[:-1], None, None, "must have 1152 elements"),
        (x, raw.view(torch.int8), None, None, "raw .* must be a contiguous CPU torch.uint8"),
        (x, raw.view(8, -1), None, None, "raw must be the 1-D"),
        (x, raw, torch.empty(2, 7), None, "out"),
        (x, raw, torch.empty(2, 8, dtype=torch.float64), None, "out"),
        (x, raw, None, (3, 9), "rows"),
        (x, raw, None, (5, 2), "rows"),
    ]
    for xi, ri, out, rows, msg in bad:
        with pytest.raises(ValueError, match=msg):
            native.linear(spec, xi, ri, out, rows)
    with pytest.raises(ValueError, match="do not compute"):
        native.linear(QuantSpec.mlx(3, 32, 8, 256), x, random_stored(QuantSpec.mlx(3, 32, 8, 256)))
    with pytest.raises(ValueError, match="do not compute"):
        native.linear(QuantSpec.ggml("BF16", 8, 256), x, torch.zeros(8 * 512, dtype=torch.uint8))
    with pytest.raises(ValueError, match="threads"):
        pool.set_threads(0)


@built
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stored_linear_chooses_by_rows(dtype):
    spec = QuantSpec.ggml("Q4_K", 40, 512)
    raw = random_stored(spec, seed=4)
    lin = StoredLinear(spec, Compute(dtype))
    assert lin.native and lin.int8 == (dtype is torch.bfloat16)
    w = spec.dequantize(raw)
    for T in (1, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1):
        x = torch.randn(T, 512).to(dtype)
        y = lin(x, raw, Scratch())
        assert y.dtype == dtype and y.shape == (T, 40)
        if dtype == torch.float32:
            check_close(y, x, w)
            if T > NATIVE_MAX_ROWS:  # the dequantize + matmul path: the reference computation itself
                assert torch.equal(y, F.linear(x, w))
        pool.set_threads(3)  # the rows split over 3 threads: the same bits
        try:
            assert torch.equal(lin(x, raw, Scratch()), y)
        finally:
            pool.set_threads(1)
    assert not StoredLinear(QuantSpec.mlx(2, 32, 8, 256), Compute(torch.float32)).native


def test_without_the_extension_stored_linear_runs_the_torch_path(monkeypatch, caplog):
    monkeypatch.setattr(_lib, "LIB", None)  # as after an install without a C compiler
    monkeypatch.setattr(_lib, "_warned", False)
    assert not native.native_available() and not native.simd()
    spec = QuantSpec.ggml("Q4_K", 8, 256)
    raw = random_stored(spec)
    x = torch.randn(2, 256)
    with caplog.at_level("WARNING"):
        lin = StoredLinear(spec, Compute(torch.float32))
        StoredLinear(spec, Compute(torch.float32))
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1  # said once, when needed
    assert "native quantized kernels not built" in caplog.records[0].message
    assert not lin.native
    assert torch.equal(lin(x, raw, Scratch()), F.linear(x, spec.dequantize(raw)))
    with pytest.raises(RuntimeError, match="not built"):
        native.linear(spec, x, raw)


@built
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_rows_over_the_pool_are_the_one_thread_bits(name):
    """native.linear (all rows) and native.dequantize split the rows over the C pool in tasks of ~64K
    weights (x T): many tasks here, the same bits as on one thread and the reference dequantization."""
    spec = QuantSpec.ggml(name, 300, 1024)
    raw = random_stored(spec, seed=11)
    x = torch.randn(12, 1024, generator=torch.Generator().manual_seed(11))
    one = native.linear(spec, x, raw)
    native.set_threads(3)
    try:
        assert torch.equal(native.linear(spec, x, raw), one)
        assert torch.equal(native.dequantize(spec, raw), spec.dequantize(raw))
    finally:
        native.set_threads(1)
    assert torch.equal(native.linear(spec, x, raw, rows=(0, 300)), one)


@pytest.mark.skipif(not native.native_available(), reason="native kernels not built")
@pytest.mark.parametrize("n", [1, 31, 32, 33, 100, 1000])
def test_float32_to_bf16_is_torchs_rounding_bitwise(n, path):
    """kernels.c's float32 -> bf16 (a bf16 dequantization's and the integer path's outputs): round to nearest even
    with subnormals kept (torch's .to(bfloat16) there) and every NaN as 0x7FC0 (c10's scalar rounding; torch's
    vectorized one keeps some payloads), on every path (AVX512_BF16's conversion flushes subnormals
    and quiets NaNs its own way: blocks holding them go through the exact rounding)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 4, (n,), generator=g)
    ties = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 3.4028235e38, -3.4028235e38])
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-39, -1e-40, 1.4e-45])
    nan_bits = torch.tensor([0x7F800001, 0xFFC00001, 0x7FFFFFFF], dtype=torch.int64).to(torch.int32).view(torch.float32)
    for extra in (ties, special, nan_bits):
        if n >= len(extra):
            at = torch.randint(0, n - len(extra) + 1, (1,), generator=g).item()
            x[at : at + len(extra)] = extra
    out = torch.empty(n, dtype=torch.bfloat16)
    lib = _lib.LIB
    lib.sluice_to_bf16.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]  # n, x, out, path
    lib.sluice_to_bf16.restype = None
    lib.sluice_to_bf16(n, x.data_ptr(), out.data_ptr(), path)
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    want = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    want = torch.where(x.isnan(), torch.tensor(0x7FC0), want)
    assert torch.equal(out.view(torch.int16).to(torch.int64) & 0xFFFF, want)
    ok = ~x.isnan()
    assert torch.equal(out[ok].view(torch.int16), x[ok].to(torch.bfloat16).view(torch.int16))
