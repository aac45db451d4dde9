"""The small native steps of a bf16 decode step (ops.c): each against the torch expression it replaces."""

from __future__ import annotations

import pytest
import torch

from sluice.models.rope import apply_rope
from sluice.quant import native

pytestmark = pytest.mark.skipif(not native.native_available(),
                                reason="native kernels not built (pip install -e . with a C compiler builds them)")


def _rope_torch(x, cos, sin):  # models/rope.py's torch expression
    rot = cos.shape[-1]
    xr, xp = (x, None) if rot == x.shape[-1] else (x[..., :rot], x[..., rot:])
    half = rot // 2
    out = xr * cos + torch.cat((-xr[..., half:], xr[..., :half]), dim=-1) * sin
    return out if xp is None else torch.cat((out, xp), dim=-1)


@pytest.mark.parametrize("T,heads,D,rot", [(1, 8, 128, 128), (5, 2, 128, 64), (33, 4, 64, 64), (40, 3, 80, 24),
                                         (700, 2, 128, 128)])
def test_rope_is_the_torch_expression_bitwise(T, heads, D, rot):
    g = torch.Generator().manual_seed(T)
    x = (torch.randn(T, heads, D, generator=g) * 5).bfloat16().transpose(0, 1)  # [heads, T, D], as attention has it
    cos, sin = (torch.randn(T, rot, generator=g).bfloat16() for _ in range(2))
    y = native.rope_bf16(x, cos, sin)
    assert y.is_contiguous() and torch.equal(y, _rope_torch(x, cos, sin))
    assert torch.equal(apply_rope(x, cos, sin), y)  # the model's rope takes the native call for bf16
    with pytest.raises(ValueError, match="rope_bf16"):
        native.rope_bf16(x.float(), cos, sin)


def test_rms_norm_is_the_reference_to_the_last_bit_of_a_rows_scale():
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 1024), (7, 1024), (3, 8, 128), (5, 100), (512, 1024)]:
        x = (torch.randn(*shape, generator=g) * 3).bfloat16()
        w = torch.randn(shape[-1], generator=g).bfloat16()
        xf = x.float()
        want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
        y = native.rms_norm_bf16(x, w, 1e-6)
        assert y.shape == x.shape and y.dtype == torch.bfloat16
        # the sum of squares in another order: a row's scale may differ in its last bit, so an element by ~an ulp
        diff = (y.float() - want.float()).abs()
        assert bool((diff <= want.float().abs() * 2**-6 + 1e-30).all()) and (y != want).float().mean() < 1e-3
    with pytest.raises(ValueError, match="rms_norm_bf16"):
        native.rms_norm_bf16(x, w[:-1], 1e-6)


def test_zero_centred_rms_norm_is_the_reference_to_the_last_bit_of_a_rows_scale():
    """rms_norm_scaled_bf16 (Norm's zero-centred form: a float32 scale, one rounding) against its torch expression;
    the vectorized rows, the portable loops and any thread count give the same bits."""
    g = torch.Generator().manual_seed(1)
    for shape in [(1, 2048), (7, 1024), (3, 16, 256), (5, 100), (600, 60)]:
        x = (torch.randn(*shape, generator=g) * 3).bfloat16()
        w = 1 + torch.randn(shape[-1], generator=g) * 0.1  # 1 + a stored weight near 0
        xf = x.float()
        want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w).bfloat16()
        y = native.rms_norm_scaled_bf16(x, w, 1e-6)
        assert y.shape == x.shape and y.dtype == torch.bfloat16
        diff = (y.float() - want.float()).abs()
        assert bool((diff <= want.float().abs() * 2**-7 + 1e-30).all()) and (y != want).float().mean() < 1e-3
        native.set_threads(2)
        try:
            split = native.rms_norm_scaled_bf16(x, w, 1e-6)
        finally:
            native.set_threads(1)
        portable = native.rms_norm_scaled_bf16(x, w, 1e-6, path=native.PORTABLE)
        assert torch.equal(split.view(torch.int16), y.view(torch.int16))
        assert torch.equal(portable.view(torch.int16), y.view(torch.int16))
    with pytest.raises(ValueError, match="rms_norm_scaled_bf16"):
        native.rms_norm_scaled_bf16(x, w.bfloat16(), 1e-6)


def _rms_norm_lanes(x, w, eps):
    """ops.c's RMSNorm step by step in float32: squares summed in 8 lanes (value i into lane i % 8, in order), the
    lanes added ((0+4)+(2+6))+((1+5)+(3+7)), scale = 1 / sqrt(sum / n + eps), then bf16(w * bf16(x * scale))."""
    n = x.shape[-1]
    xf = x.float().reshape(-1, n)
    lane = torch.zeros(xf.shape[0], 8)
    for i in range(n):
        lane[:, i % 8] = lane[:, i % 8] + xf[:, i] * xf[:, i]
    a, b = (lane[:, 0] + lane[:, 4]) + (lane[:, 2] + lane[:, 6]), (lane[:, 1] + lane[:, 5]) + (lane[:, 3] + lane[:, 7])
    total = a + b
    scale = 1.0 / torch.sqrt(total / torch.tensor(float(n)) + torch.tensor(eps, dtype=torch.float32))
    y = (w.float() * (xf * scale[:, None]).bfloat16().float()).bfloat16()
    return y.reshape(x.shape)


@pytest.mark.parametrize("shape", [(1, 1024), (3, 100), (70, 8, 128), (600, 60)])
def test_rms_norm_is_its_lane_order_bitwise_on_any_path(shape):
    """The vectorized rows (AVX2 where it runs), the portable loops and the lane-by-lane reference agree bitwise,
    rows over the pool; n not a multiple of 8 takes the tail into its lanes alike."""
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).bfloat16()
    x.view(-1)[:3] = torch.tensor([0.0, -0.0, 1e-30]).bfloat16()
    w = torch.randn(shape[-1], generator=g).bfloat16()
    native.set_threads(2)
    try:
        fast = native.rms_norm_bf16(x, w, 1e-6)
        portable = native.rms_norm_bf16(x, w, 1e-6, path=native.PORTABLE)
    finally:
        native.set_threads(1)
    want = _rms_norm_lanes(x, w, 1e-6)
    assert torch.equal(fast.view(torch.int16), want.view(torch.int16))
    assert torch.equal(portable.view(torch.int16), want.view(torch.int16))


def test_rope_and_combine_rows_take_the_same_bits_on_the_portable_path():
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(37, 3, 80, generator=g) * 5).bfloat16().transpose(0, 1)
    cos, sin = (torch.randn(37, 24, generator=g).bfloat16() for _ in range(2))
    T, K, H = 50, 4, 100
    ys = torch.randn(T * K, H, generator=g).bfloat16()
    w, at = torch.rand(T * K, generator=g), torch.randperm(T * K, generator=g).view(T, K)
    out = []
    for path in (native.BEST, native.PORTABLE):
        out.append((native.rope_bf16(x, cos, sin, path=path),
                    native.combine_rows_bf16(ys, w, at, torch.empty(T, H, dtype=torch.bfloat16), path=path)))
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(*out))


@pytest.mark.parametrize("path", [native.BEST, native.PORTABLE])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_combine_is_the_torch_expression_bitwise(wdtype, path):
    """On the AVX2 loop and the portable one; H = 1028 leaves 4 values past the last 8 for the tail loop."""
    g = torch.Generator().manual_seed(1)
    for _ in range(10):
        n, H, K = 5, 1028, 8
        ys = torch.randn(n, H, generator=g) * 10.0 ** torch.randint(-3, 3, (n, 1), generator=g)
        ys[0, :3] = torch.tensor([float("inf"), -float("inf"), 1e38])
        w = torch.rand(1, K, generator=g).to(wdtype)
        at = torch.randperm(K, generator=g)[:n].tolist()
        start = torch.randn(1, H, generator=g).bfloat16()
        got = start.clone()
        native.combine_bf16(ys, w, at, got, path=path)
        want = start.clone()
        part = (ys.to(torch.bfloat16) * w[0, at].unsqueeze(1)).to(torch.bfloat16)
        for j in range(n):
            want += part[j : j + 1]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    with pytest.raises(ValueError, match="combine_bf16"):
        native.combine_bf16(ys, w, [K], got)


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_combine_rows_is_the_torch_expression_bitwise(wdtype, threads):
    """A prompt's weighted sum (Transformer.experts): the torch lines it replaced, on any number of threads."""
    g = torch.Generator().manual_seed(threads)
    native.set_threads(threads)
    try:
        for T, K, H in ((1, 8, 64), (77, 8, 100), (300, 4, 128)):
            ys = torch.randn(T * K, H, generator=g) * 10.0 ** torch.randint(-3, 3, (T * K, 1), generator=g)
            ys[0, :4] = torch.tensor([float("inf"), -float("inf"), 3e38, -0.0])
            ys = ys.bfloat16()
            w = torch.rand(T * K, generator=g).to(wdtype)
            w[1 % (T * K)] = 0.0
            at = torch.randperm(T * K, generator=g).view(T, K)
            before = ys.clone()
            got = native.combine_rows_bf16(ys, w, at, torch.empty(T, H, dtype=torch.bfloat16))
            assert torch.equal(ys.view(torch.int16), before.view(torch.int16))  # ys is left as it was
            want, part = torch.zeros(T, H, dtype=torch.bfloat16), torch.empty(T, H, dtype=torch.bfloat16)
            scaled = before.clone().mul_(w[:, None])
            for r in range(K):
                want += torch.index_select(scaled, 0, at[:, r], out=part)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    finally:
        native.set_threads(1)
    with pytest.raises(ValueError, match="combine_rows_bf16"):
        native.combine_rows_bf16(ys, w, at + T * K, torch.empty(T, H, dtype=torch.bfloat16))


@pytest.mark.parametrize("n", [1, 7, 8, 16384, 16384 * 3 + 5])
def test_add_is_torchs_bitwise_on_every_path(n):
    """ops.add_bf16 (a prompt's residual add over the pool) is torch's bf16 `a + b` bit for bit on the AVX2 and the
    portable loops: ties to even, infinities, overflow to inf, subnormals; a NaN sum is the 0x7fc0 NaN."""
    from sluice.quant.native import ops
    from tests.quant import paths

    g = torch.Generator().manual_seed(n)
    a = (torch.randn(n, generator=g) * torch.logspace(-38, 38, n)).bfloat16()
    b = (torch.randn(n, generator=g) * torch.logspace(38, -38, n)).bfloat16()
    if n >= 8:
        a[:6] = torch.tensor([float("inf"), float("nan"), 3.3e38, 1e-39, 1.0, -0.0]).bfloat16()
        b[:6] = torch.tensor([-float("inf"), 1.0, 3.3e38, 1e-39, 2.0 ** -8, 0.0]).bfloat16()  # 1 + 2^-8: a tie
    ref = a + b
    nan = ref.isnan()
    outs = paths.on_each(lambda path: ops.add_bf16(a, b, path=path))
    for out in outs:
        assert torch.equal(out.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])
        assert (out.view(torch.int16)[nan] == 0x7FC0).all()
    with pytest.raises(ValueError, match="bf16"):
        ops.add_bf16(a, b.float())


@pytest.mark.parametrize("n", [1, 9, 16384 * 2 + 3])
def test_widening_is_torchs_bitwise_on_every_path(n):
    """ops.to_float32 (a prompt's bf16 rows for a float32 GEMM, over the pool) is x.float() bit for bit, NaN
    payloads and signed zeros included; rows_linear takes it from NATIVE_WIDEN_ROWS rows (the same product)."""
    from sluice.quant.matmul import NATIVE_WIDEN_ROWS, rows_linear
    from sluice.quant.native import ops
    from tests.quant import paths

    g = torch.Generator().manual_seed(n)
    x = torch.randint(-32768, 32767, (n,), generator=g, dtype=torch.int16).view(torch.bfloat16)  # every bit pattern
    for out in paths.on_each(lambda path: ops.to_float32(x, path=path)):
        assert torch.equal(out.view(torch.int32), x.float().view(torch.int32))
    rows = torch.randn(NATIVE_WIDEN_ROWS + 3, 256, generator=g).bfloat16()
    w = torch.randn(48, 256, generator=g).bfloat16()
    assert torch.equal(rows_linear(rows, w), torch.nn.functional.linear(rows.float(), w.float()).bfloat16())
