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


@pytest.mark.parametrize("T,heads,D,rot", [(1, 8, 128, 128), (5, 2, 128, 64), (33, 4, 64, 64)])
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


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_combine_is_the_torch_expression_bitwise(wdtype):
    g = torch.Generator().manual_seed(1)
    for _ in range(10):
        n, H, K = 5, 1024, 8
        ys = torch.randn(n, H, generator=g) * 10.0 ** torch.randint(-3, 3, (n, 1), generator=g)
        ys[0, :3] = torch.tensor([float("inf"), -float("inf"), 1e38])
        w = torch.rand(1, K, generator=g).to(wdtype)
        at = torch.randperm(K, generator=g)[:n].tolist()
        start = torch.randn(1, H, generator=g).bfloat16()
        got = start.clone()
        native.combine_bf16(ys, w, at, got)
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
        for T, K, H in ((1, 8, 64), (77, 8, 96), (300, 4, 128)):
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
