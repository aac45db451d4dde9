"""The integer path (sluice/quant/native/q8.c): x quantized to 8-bit codes (1 or 2 planes), integer dots.

Its accuracy, written down here: relative L2 of y against F.linear on the exactly dequantized weights ([256 x 1024],
random blocks, 5 seeds of 4 rows; every format within the range given):
                                                  planes=1 (llama.cpp's)   planes=2 (the default)
  Gaussian x                                      5.1e-3 - 6.8e-3          1.9e-5 - 2.3e-5
  heavy-tailed x (channels scaled by e^N(0,1))    6.8e-3 - 1.1e-2          3.0e-5 - 4.0e-5
  the K-quants with planes=1 (one scale per 256 values, llama.cpp's Q8_K):
  Gaussian x                                      6.6e-3 - 7.7e-3
  heavy-tailed x                                  1.6e-2 - 2.3e-2
The test bounds are 1e-2 / 1.5e-2 (planes=1; K-quants 1e-2 / 3e-2) and 1e-4 (planes=2). The AVX2 and the scalar C
paths give the same bits (so does the AVX-512 rounding of bf16 outputs, tests/quant/paths.py); so does any T.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.quant import native
from sluice.quant.compute import Compute
from sluice.quant.linear import NATIVE_MAX_ROWS, Q8_MAX_ROWS, Scratch, StoredLinear
from sluice.quant.native import pool
from sluice.quant.spec import QuantSpec
from tests.quant.samples import random_expert_slots, random_stored
from tests.quant import paths

pytestmark = pytest.mark.skipif(not native.native_available(),
                                reason="native kernels not built (pip install -e . with a C compiler builds them)")

Q8 = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
# odd row counts, odd block counts (K-quants: 3 blocks of 256; the rest: 7 blocks of 32)
SPECS = [QuantSpec.ggml(n, 37, 768 if n.endswith("K") else 224) for n in Q8]


def rel_l2(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = F.linear(x.double(), w.double())
    return float((y.double() - ref).norm() / ref.norm())


def both_paths(fn, monkeypatch=None) -> list:
    """fn(path) on each C path this CPU runs (AVX2 and the portable one, and AVX-512 where it has it:
    tests/quant/paths.py), the portable one last."""
    return paths.on_each(fn)


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_within_the_bound_of_the_exact_weights_and_the_same_bits_on_both_paths(spec, T, planes, monkeypatch):
    raw = random_stored(spec, seed=T)
    x = torch.randn(T, spec.in_features, generator=torch.Generator().manual_seed(T))
    ys = both_paths(lambda path: native.linear_q8(spec, x, raw, planes=planes, path=path), monkeypatch)
    assert ys[0].shape == (T, spec.out_features) and ys[0].dtype == torch.float32
    assert rel_l2(ys[0], x, spec.dequantize(raw)) <= (1e-2 if planes == 1 else 1e-4)
    # row t does not depend on T; a given quantized x gives the same y
    mid = x[T // 2:T // 2 + 1].contiguous()
    assert torch.equal(native.linear_q8(spec, mid, raw, planes=planes), ys[0][T // 2:T // 2 + 1])
    xq = native.quantize_q8(x, planes, spec=spec)
    assert torch.equal(native.linear_q8(spec, x, raw, xq=xq, planes=planes), ys[0])
    paths.same_bits(ys)


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_heavy_tailed_activations_stay_within_the_bound(spec, planes):
    # activations with outliers (per-channel scales over 3 decades, as in real hidden states)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, spec.in_features, generator=g) * torch.exp(torch.randn(spec.in_features, generator=g))
    raw = random_stored(spec, seed=7)
    y = native.linear_q8(spec, x, raw, planes=planes)
    bound = (3e-2 if spec.name.endswith("K") else 1.5e-2) if planes == 1 else 1e-4
    assert rel_l2(y, x, spec.dequantize(raw)) <= bound


@pytest.mark.parametrize("planes", [1, 2])
def test_quantized_x_layout(planes, monkeypatch):
    """Per 32 values: float d, float d * sum(codes), int8 hi[32] = round(x / D) with D = amax / 127, and with two
    planes int8 lo[32] = round((x / D - hi) * 256); the code is hi (d = D) or 256 * hi + lo (d = D / 256)."""
    K, B = 512, 8 + 32 * planes
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(planes)) * 3
    x[1, :64] = 0  # all-zero blocks: d = 0, codes 0
    xqs = both_paths(lambda path: native.quantize_q8(x, planes, path=path), monkeypatch)
    assert xqs[0].shape == (2, native.q8_row_bytes(K, planes)) == (2, K // 32 * B)
    blocks = xqs[0].view(2, K // 32, B)
    d = blocks[..., :4].contiguous().view(torch.float32)[..., 0]  # [2, blocks]
    s = blocks[..., 4:8].contiguous().view(torch.float32)[..., 0]
    hi = blocks[..., 8:40].contiguous().view(torch.int8).float()  # [2, blocks, 32]
    xb = x.view(2, K // 32, 32)
    D = xb.abs().amax(-1) / 127
    # 127 / amax correctly rounded (torch's scalar / tensor multiplies by a reciprocal), then x times it, as q8.c
    f = xb * (127 / xb.abs().amax(-1, keepdim=True).double()).float()
    assert torch.equal(hi, torch.round(f).nan_to_num(0.0))
    assert hi.abs().max() <= 127 and not hi[1, :2].any()
    code = hi
    if planes == 2:
        lo = blocks[..., 40:].contiguous().view(torch.int8).float()
        assert torch.equal(lo, torch.round((f - hi) * 256).clamp(-127, 127).nan_to_num(0.0))
        code = 256 * hi + lo
        D = D / 256
    assert torch.equal(d, D)
    assert bool(((code * d[..., None] - xb).abs() <= d[..., None] * (0.5 if planes == 1 else 1.0) * (1 + 1e-6)).all())
    assert torch.equal(s, d * code.sum(-1))
    paths.same_bits(xqs)


def test_super_block_layout_of_the_k_quants(monkeypatch):
    """The K-quants with two planes read x in super-blocks: per 256 values float d = D / 256 (D = amax / 127), int32
    bsum[16] = the sum of each 16 values' codes 256 * hi + lo, int8 hi[256] = round(x / D), int8 lo[256] =
    round((x / D - hi) * 256); the 32-value formats keep their layout."""
    K = 512
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(5)) * 3
    x[1, :256] = 0  # an all-zero super-block: d = 0, codes 0
    spec = QuantSpec.ggml("Q4_K", 4, K)
    xqs = both_paths(lambda path: native.quantize_q8(x, 2, spec=spec, path=path), monkeypatch)
    assert xqs[0].shape == (2, native.q8_row_bytes(K, 2, spec)) == (2, K // 256 * 580)
    assert native.q8_row_bytes(K, 2, QuantSpec.ggml("Q8_0", 4, K)) == native.q8_row_bytes(K, 2) == K // 32 * 72
    assert native.q8_row_bytes(K, 1, QuantSpec.ggml("Q8_0", 4, K)) == native.q8_row_bytes(K, 1) == K // 32 * 40
    sb = xqs[0].view(2, K // 256, 580)
    d = sb[..., :4].contiguous().view(torch.float32)[..., 0]  # [2, super-blocks]
    bsum = sb[..., 4:68].contiguous().view(torch.int32)  # [2, sb, 16]
    hi = sb[..., 68:324].contiguous().view(torch.int8).float()
    lo = sb[..., 324:].contiguous().view(torch.int8).float()
    xb = x.view(2, K // 256, 256)
    f = xb * (127 / xb.abs().amax(-1, keepdim=True).double()).float()
    assert torch.equal(hi, torch.round(f).nan_to_num(0.0))
    assert torch.equal(lo, torch.round((f - hi) * 256).clamp(-127, 127).nan_to_num(0.0))
    assert torch.equal(d, xb.abs().amax(-1) / 127 / 256)
    code = 256 * hi + lo
    assert torch.equal(bsum, code.view(2, K // 256, 16, 16).sum(-1).int())
    assert bool(((code * d[..., None] - xb).abs() <= d[..., None] * (1 + 1e-6)).all())
    assert not hi[1, 0].any() and d[1, 0] == 0
    # the same bits from linear_q8 with this xq as with x
    raw = random_stored(spec)
    assert torch.equal(native.linear_q8(spec, x, raw, xq=xqs[0]), native.linear_q8(spec, x, raw))
    paths.same_bits(xqs)


def test_one_plane_super_block_layout_of_the_k_quants(monkeypatch):
    """With one plane the K-quants read llama.cpp's Q8_K layout: per 256 values float d = D (amax / 127), int32
    bsum[16] = the sum of each 16 values' codes, int8 hi[256] = round(x / D) (324 bytes)."""
    K = 512
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(6)) * 3
    x[1, 256:] = 0
    spec = QuantSpec.ggml("Q6_K", 4, K)
    xqs = both_paths(lambda path: native.quantize_q8(x, 1, spec=spec, path=path), monkeypatch)
    assert xqs[0].shape == (2, native.q8_row_bytes(K, 1, spec)) == (2, K // 256 * 324)
    sb = xqs[0].view(2, K // 256, 324)
    d = sb[..., :4].contiguous().view(torch.float32)[..., 0]
    bsum = sb[..., 4:68].contiguous().view(torch.int32)
    hi = sb[..., 68:].contiguous().view(torch.int8).float()
    xb = x.view(2, K // 256, 256)
    f = xb * (127 / xb.abs().amax(-1, keepdim=True).double()).float()
    assert torch.equal(hi, torch.round(f).nan_to_num(0.0))
    assert torch.equal(d, xb.abs().amax(-1) / 127)
    assert torch.equal(bsum, hi.view(2, K // 256, 16, 16).sum(-1).int())
    assert not hi[1, 1].any() and d[1, 1] == 0
    raw = random_stored(spec)
    ys = both_paths(lambda path: native.linear_q8(spec, x, raw, xq=xqs[0], planes=1, path=path), monkeypatch)
    assert torch.equal(ys[0], native.linear_q8(spec, x, raw, planes=1))
    paths.same_bits(xqs)
    paths.same_bits(ys)


def test_nonfinite_activations_do_not_crash():
    spec = QuantSpec.ggml("Q4_K", 3, 256)
    x = torch.randn(2, 256)
    x[0, 3], x[1, 9] = float("nan"), float("inf")
    xq = native.quantize_q8(x).view(2, 8, 72)[..., 8:].contiguous().view(torch.int8)
    assert xq.abs().max() <= 127
    native.linear_q8(spec, x, random_stored(spec))


def test_bad_inputs_raise_value_errors():
    spec = QuantSpec.ggml("Q6_K", 8, 256)
    raw = random_stored(spec)
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="int8 path does not compute"):  # (the low-bit types: test_q8_low.py)
        native.linear_q8(QuantSpec.ggml("BF16", 8, 256), x, random_stored(QuantSpec.ggml("BF16", 8, 256)))
    with pytest.raises(ValueError, match="multiple of 32"):
        native.quantize_q8(torch.randn(2, 255))
    with pytest.raises(ValueError, match="xq"):
        native.linear_q8(spec, x, raw, xq=torch.empty(2, 575, dtype=torch.uint8))
    with pytest.raises(ValueError, match="xq"):
        native.quantize_q8(x, out=torch.empty(2, 576, dtype=torch.int8))
    with pytest.raises(ValueError, match="planes"):
        native.linear_q8(spec, x, raw, planes=3)
    assert not native.q8_supported(QuantSpec.mlx(4, 64, 8, 256)) and native.q8_supported(spec)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_kernel_runs_int8_at_bf16_and_f16_and_float_at_float32(dtype):
    """(--matmul float32: the bf16 GEMM route of many rows is tests/quant/test_native.py's)"""
    spec = QuantSpec.ggml("Q4_K", 40, 512)
    raw = random_stored(spec, seed=4)
    k = StoredLinear(spec, Compute(dtype, bf16_gemm=False))
    scratch = Scratch()
    for T in (1, Q8_MAX_ROWS, Q8_MAX_ROWS + 1, NATIVE_MAX_ROWS + 1):
        x = torch.randn(T, 512)
        y = k(x.to(dtype), raw, scratch)
        xf = x.to(dtype).float()
        if T > NATIVE_MAX_ROWS:  # many rows: dequantize + float32 matmul at every dtype
            want = F.linear(xf, spec.dequantize(raw))
        elif dtype is torch.float32 or T > Q8_MAX_ROWS:  # the float row kernel
            want = native.linear(spec, xf, raw)
        else:
            want = native.linear_q8(spec, xf, raw)
        assert torch.equal(y, want.to(dtype))
    assert not StoredLinear(QuantSpec.mlx(4, 64, 8, 256), Compute(torch.bfloat16)).int8


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("T", [1, 5])
def test_one_call_expert_is_the_three_projections(T, planes, monkeypatch):
    """native.expert_q8 = down(silu(gate x) * up x), each projection as linear_q8 computes it (a Q4_K_M-like mix:
    Q4_K gate / up, Q6_K down), and within the int8 bound of the exact float64 expert."""
    H, I = 512, 256
    specs = (QuantSpec.ggml("Q4_K", I, H), QuantSpec.ggml("Q4_K", I, H), QuantSpec.ggml("Q6_K", H, I))
    raws = tuple(random_stored(s, seed=k) for k, s in enumerate(specs))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    ys = both_paths(lambda path: native.expert_q8(specs, raws, x, planes=planes, path=path), monkeypatch)
    assert ys[0].shape == (T, H)
    g, u = (native.linear_q8(s, x, r, planes=planes) for s, r in zip(specs[:2], raws[:2]))
    # silu in float32 (libm's expf there, torch's exp here: equal to an ulp)
    want = native.linear_q8(specs[2], (g / (1 + torch.exp(-g)) * u).contiguous(), raws[2], planes=planes)
    assert float((ys[0] - want).norm() / want.norm()) <= 1e-5
    w = [s.dequantize(r).double() for s, r in zip(specs, raws)]
    exact = F.linear(F.silu(F.linear(x.double(), w[0])) * F.linear(x.double(), w[1]), w[2])
    assert rel_l2(ys[0], exact, torch.eye(H)) <= (3e-2 if planes == 1 else 1e-4)
    assert torch.equal(native.expert_q8(specs, raws, x[T - 1:].contiguous(), planes=planes), ys[0][T - 1:])
    with pytest.raises(ValueError, match="expert shapes"):
        native.expert_q8((specs[0], specs[2], specs[2]), raws, x)
    with pytest.raises(ValueError, match="int8 path does not compute"):
        native.expert_q8((QuantSpec.mlx(4, 64, I, H),) + specs[1:], raws, x)
    paths.same_bits(ys)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_expert_math_runs_one_native_call_at_bf16_and_the_float_kernels_at_float32(dtype, monkeypatch):
    from sluice.models.layers.experts import EXPERT_Q8_MAX_ROWS, ExpertMath
    from sluice.store.base import ExpertBatch
    from sluice.store.layout import ExpertFormat

    H, I = 256, 256
    fmt = ExpertFormat.of(QuantSpec.ggml("Q4_K", I, H), QuantSpec.ggml("Q4_K", I, H), QuantSpec.ggml("Q6_K", H, I))
    slot = random_expert_slots(fmt, 1)
    batch = ExpertBatch(None, None, [0], raw=slot, format=fmt)
    calls = []
    one_call = native.expert_q8
    real = native.ExpertCall.__call__
    monkeypatch.setattr(native.ExpertCall, "__call__", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(EXPERT_Q8_MAX_ROWS, H).to(dtype)
    y = ExpertMath(Compute(dtype), F.silu)[fmt](batch, 0, x)
    assert y.dtype == dtype and y.shape == (EXPERT_Q8_MAX_ROWS, H)
    parts = (slot[0, :fmt.gate.nbytes], slot[0, fmt.up_offset:fmt.up_offset + fmt.up.nbytes],
             slot[0, fmt.down_offset:fmt.down_offset + fmt.down.nbytes])
    if dtype is torch.float32:  # the exact float kernels, projection by projection
        assert not calls
        g, u = (native.linear(s, x, r) for s, r in zip((fmt.gate, fmt.up), parts[:2]))
        assert torch.equal(y, native.linear(fmt.down, F.silu(g) * u, parts[2]))
    else:
        assert calls == [1]
        assert torch.equal(y, one_call((fmt.gate, fmt.up, fmt.down), parts, x.float()).to(dtype))
        assert ExpertMath(Compute(dtype), F.gelu)[fmt](batch, 0, x) is not None and calls == [1]  # 3 calls
    x = torch.randn(EXPERT_Q8_MAX_ROWS + 1, H).to(dtype)  # more rows: three kernel calls, not the one call
    ExpertMath(Compute(dtype), F.silu)[fmt](batch, 0, x)
    assert len(calls) == (0 if dtype is torch.float32 else 1)


def test_the_planes_are_each_calls_own():
    """Two planes unless a call names one (a model names its own: Compute.planes); nothing is read process-wide."""
    spec = QuantSpec.ggml("Q8_0", 8, 64)
    raw, x = random_stored(spec), torch.randn(1, 64)
    two = native.linear_q8(spec, x, raw)
    assert torch.equal(two, native.linear_q8(spec, x, raw, planes=2))
    one = native.linear_q8(spec, x, raw, planes=1)
    assert not torch.equal(one, two) and torch.equal(native.linear_q8(spec, x, raw), two)
    assert native.quantize_q8(x, 1).shape == (1, native.q8_row_bytes(64, 1)) == (1, 80)


def test_expert_call_is_expert_q8_with_the_checks_done_once():
    H, I = 256, 256
    from sluice.store.layout import ExpertFormat

    fmt = ExpertFormat.of(QuantSpec.ggml("Q4_K", I, H), QuantSpec.ggml("Q4_K", I, H), QuantSpec.ggml("Q6_K", H, I))
    slot = random_expert_slots(fmt, 1)[0]
    parts = (slot[:fmt.gate.nbytes], slot[fmt.up_offset:fmt.up_offset + fmt.up.nbytes],
             slot[fmt.down_offset:fmt.down_offset + fmt.down.nbytes])
    call = native.ExpertCall((fmt.gate, fmt.up, fmt.down), (0, fmt.up_offset, fmt.down_offset))
    x = torch.randn(3, H)
    out = torch.empty(3, H)
    call(slot, x, out)
    assert torch.equal(out, native.expert_q8((fmt.gate, fmt.up, fmt.down), parts, x))
    with pytest.raises(ValueError, match="expert slot"):
        call(slot[:-1], x, out)
    with pytest.raises(ValueError, match="expert x / out"):
        call(slot, x.bfloat16(), out)
    with pytest.raises(ValueError, match="expert x / out"):
        call(slot, x, out[:2])


@pytest.fixture
def c_threads():
    """pool.set_threads(n) for the test (the C pool), back to one thread after it."""
    yield pool.set_threads
    pool.set_threads(1)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("T", [1, 2, 5])
def test_linears_q8_are_linear_q8_on_any_thread_count(T, threads, c_threads, monkeypatch):
    """Several projections of one x in one call, rows split over the C pool: each y is linear_q8's, bitwise, on both
    C paths; a 3-row projection (fewer rows than a task) and a mix of formats included."""
    c_threads(threads)
    specs = [QuantSpec.ggml(n, rows, 512) for n, rows in (("Q4_K", 300), ("Q6_K", 3), ("Q8_0", 129), ("Q5_0", 64))]
    raws = [random_stored(s, seed=k) for k, s in enumerate(specs)]
    x = torch.randn(T, 512, generator=torch.Generator().manual_seed(T))
    call = native.LinearsQ8(list(zip(specs, raws)))
    every = []
    for planes in (1, 2):
        outs = both_paths(lambda path: call(x, planes=planes, path=path), monkeypatch)
        for y, s, r in zip(outs[0], specs, raws):
            assert y.shape == (T, s.out_features) and y.is_contiguous()
            assert torch.equal(y, native.linear_q8(s, x, r, planes=planes))
        bf16 = both_paths(lambda path: call(x, planes=planes, out_dtype=torch.bfloat16, path=path), monkeypatch)
        for y, b in zip(outs[0], bf16[0]):  # rounded in C as .to rounds
            assert b.dtype == torch.bfloat16 and torch.equal(b, y.to(torch.bfloat16))
        every += [outs, bf16]
    with pytest.raises(ValueError, match="share in_features"):
        native.LinearsQ8([(specs[0], raws[0]), (QuantSpec.ggml("Q8_0", 4, 64), random_stored(QuantSpec.ggml(
            "Q8_0", 4, 64)))])
    with pytest.raises(ValueError, match="x must be"):
        call(torch.randn(T, 256))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        call(x, out_dtype=torch.float16)
    for outs in every:
        paths.same_bits(outs)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("T", [1, 3])
def test_experts_in_one_call_are_each_expert_q8(T, threads, c_threads, monkeypatch):
    """ExpertCall.many: n experts on one x, their rows split over the C pool in three steps, each output bitwise
    call()'s (= expert_q8's) for that expert, on both C paths and any thread count; one expert alone too."""
    from sluice.store.layout import ExpertFormat

    c_threads(threads)
    H, I = 512, 256
    fmt = ExpertFormat.of(QuantSpec.ggml("Q4_K", I, H), QuantSpec.ggml("Q4_K", I, H), QuantSpec.ggml("Q6_K", H, I))
    slots = random_expert_slots(fmt, 5)
    call = native.ExpertCall((fmt.gate, fmt.up, fmt.down), (0, fmt.up_offset, fmt.down_offset))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    want = torch.empty(5, T, H)
    for e in range(5):
        call(slots[e], x, want[e])
    every = []
    for order in ([0, 1, 2, 3, 4], [3], [4, 0, 2]):
        def run(path):
            ys = torch.full((6, T, H), float("nan"))
            call.many(slots, order, x, ys, [e + 1 for e in order], path=path)  # expert e into row e + 1
            return ys
        rows = [e + 1 for e in order]
        outs = both_paths(run, monkeypatch)
        assert torch.equal(outs[0][rows], want[order])
        assert all(ys[r].isnan().all() for ys in outs for r in range(6) if r - 1 not in order)
        every.append([ys[rows] for ys in outs])
    with pytest.raises(ValueError, match="expert slots"):
        call.many(slots[:, :-1], [0], x, torch.empty(1, T, H), [0])
    with pytest.raises(ValueError, match="expert slots"):
        call.many(slots, [5], x, torch.empty(1, T, H), [0])
    with pytest.raises(ValueError, match="expert outputs"):
        call.many(slots, [0], x, torch.empty(1, T, H + 1), [0])
    with pytest.raises(ValueError, match="expert outputs"):
        call.many(slots, [0, 1], x, torch.empty(2, T, H), [0, 2])
    for outs in every:
        paths.same_bits(outs)


def test_back_to_back_jobs_from_two_threads_keep_their_bits(c_threads):
    """pool.c hands a job's tasks out through a claim tagged with the job's id, and the caller waits for the tasks
    to finish, not for the workers to show up: hundreds of short jobs back to back (ExpertCall.many runs three per
    call), from two Python threads at once (a call made while the other's job holds the pool runs on its own
    thread), each give the one-thread bits; a worker that wakes up late for a finished job runs nothing of the next
    one (it would write another job's rows, or run a task with the wrong job's arguments)."""
    import threading

    from sluice.store.layout import ExpertFormat

    H, I = 512, 256
    fmt = ExpertFormat.of(QuantSpec.ggml("Q4_K", I, H), QuantSpec.ggml("Q4_K", I, H), QuantSpec.ggml("Q6_K", H, I))
    slots = random_expert_slots(fmt, 6)
    call = native.ExpertCall((fmt.gate, fmt.up, fmt.down), (0, fmt.up_offset, fmt.down_offset))
    xs = [torch.randn(1, H, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    orders = [[0, 2, 5], [1], [4, 3, 1, 0, 2, 5]]
    c_threads(1)
    want = {}
    for k, x in enumerate(xs):
        for o, order in enumerate(orders):
            want[k, o] = torch.empty(len(order), H)
            call.many(slots, order, x, want[k, o], list(range(len(order))))
    c_threads(3)
    wrong: list = []

    def run(k: int) -> None:
        for i in range(300):
            o = i % len(orders)
            ys = torch.empty(len(orders[o]), H)
            call.many(slots, orders[o], xs[k], ys, list(range(len(orders[o]))))
            if not torch.equal(ys, want[k, o]):
                wrong.append((k, i))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_the_largest_min_terms_are_exact_on_both_paths(name, planes, monkeypatch):
    """The AVX2 path sums a K-quant block's min term (mins or Q6_K scales times x's 16-value sums) in int32 lanes:
    with every min / scale at its extreme and x at the largest codes, both paths still give the same bits and the
    exact weights' result."""
    spec = QuantSpec.ggml(name, 8, 1024)
    raw = random_stored(spec, seed=3)
    blocks = raw.view(spec.out_features, -1, {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[name])
    if name == "Q6_K":
        blocks[..., 192:208] = torch.tensor([128, 127] * 8, dtype=torch.uint8)  # scales -128, 127
    else:
        blocks[..., 4:16] = 255  # every 6-bit scale and min 63
    w = spec.dequantize(raw)
    every = []
    for x in (torch.ones(2, 1024), -torch.ones(2, 1024)):
        every.append(both_paths(lambda path: native.linear_q8(spec, x, raw, planes=planes, path=path), monkeypatch))
        assert rel_l2(every[-1][0], x, w) <= (1e-2 if planes == 1 else 1e-4)
    for ys in every:
        paths.same_bits(ys)


def test_the_prefetch_distance_does_not_change_the_bits():
    spec = QuantSpec.ggml("Q4_K", 300, 1024)
    raw = random_stored(spec, seed=5)
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(5))
    try:
        ys = []
        for nbytes in (0, 64, 2048, 1 << 20):
            native.q8.set_prefetch(nbytes)
            ys.append(native.linear_q8(spec, x, raw))
    finally:
        native.q8.set_prefetch(2048)
    assert all(torch.equal(ys[0], y) for y in ys)


@pytest.mark.parametrize("spread", [1, 4, 1 << 30])
def test_the_task_length_does_not_change_the_bits(spread, c_threads):
    """Long tasks (q8.c task_rows, native.q8.set_task_spread) or the old 64K-weight ones: the same rows, the same bits
    (projections in one call, and a layer's experts)."""
    from sluice.store.layout import ExpertFormat

    c_threads(2)
    specs = [QuantSpec.ggml("Q4_K", 1024, 1024), QuantSpec.ggml("Q6_K", 256, 1024)]
    raws = [random_stored(s, seed=k) for k, s in enumerate(specs)]
    x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(7))
    fmt = ExpertFormat.of(QuantSpec.ggml("Q4_K", 512, 1024), QuantSpec.ggml("Q4_K", 512, 1024),
                          QuantSpec.ggml("Q6_K", 1024, 512))
    slots = random_expert_slots(fmt, 8)
    call = native.ExpertCall((fmt.gate, fmt.up, fmt.down), (0, fmt.up_offset, fmt.down_offset))
    want = [native.linear_q8(s, x, r) for s, r in zip(specs, raws)]
    want_e = torch.empty(8, 2, 1024)
    for e in range(8):
        call(slots[e], x, want_e[e])
    try:
        native.q8.set_task_spread(spread)
        got = native.LinearsQ8(list(zip(specs, raws)))(x)
        ys = torch.empty(8, 2, 1024)
        call.many(slots, list(range(8)), x, ys, list(range(8)))
    finally:
        native.q8.set_task_spread(4)
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and torch.equal(ys, want_e)
