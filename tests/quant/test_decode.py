"""One decode token's native attention and router (native/decode.py, decode.c) against the torch code they replace."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sluice.models.layers.norm import Norm
from sluice.models.layers.sinks import sink_attention
from sluice.models.rope import apply_rope
from sluice.quant import native
from sluice.quant.native.decode import DecodeAttention, Guess, router_probs_bf16, topk_probs
from tests.quant.paths import on_each, same_bits

pytestmark = pytest.mark.skipif(not native.native_available(),
                                reason="native kernels not built (pip install -e . with a C compiler builds them)")

P = 64  # cache positions


def _case(nH, nKV, D, rot, norm, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 2).bfloat16()  # noqa: E731
    q, k, v = r(1, nH * D), r(1, nKV * D), r(1, nKV * D)
    n = {"none": (None, None), "head": (r(D), r(D)), "full": (r(nH * D), r(nKV * D))}[norm]
    cos, sin = r(P, rot), r(P, rot)
    ck, cv = r(nKV, P, D), r(nKV, P, D)  # earlier positions hold random keys and values
    return q, k, v, n, cos, sin, ck, cv


def _torch_attention(q, k, v, norm, qn, kn, cos, sin, ck, cv, pos, lo, clip, sinks, nH, nKV, D, zero_centred=False):
    """models/layers/attention.py Attention's torch steps for one token: (the cache after, the exact float64
    attention of the bf16 q and keys it computes, SDPA's / sink_attention's bf16 output). zero_centred: the norms
    scale by 1 + weight (Norm)."""
    eps = 1e-6
    qnorm, knorm = (Norm(w, eps, zero_centred=zero_centred) if w is not None else None for w in (qn, kn))
    if norm == "full":
        q, k = qnorm(q), knorm(k)
    if clip is not None:
        q, k, v = (t.clamp(-clip, clip) for t in (q, k, v))
    q, k = q.view(1, nH, D), k.view(1, nKV, D)
    if norm == "head":
        q, k = qnorm(q), knorm(k)
    q = apply_rope(q.transpose(0, 1), cos[pos : pos + 1], sin[pos : pos + 1])  # [nH, 1, D]
    k = apply_rope(k.transpose(0, 1), cos[pos : pos + 1], sin[pos : pos + 1])
    ck, cv = ck.clone(), cv.clone()
    ck[:, pos : pos + 1] = k
    cv[:, pos : pos + 1] = v.view(1, nKV, D).transpose(0, 1)
    keys, vals = ck[:, lo : pos + 1].double(), cv[:, lo : pos + 1].double()  # [nKV, n, D]
    rep = nH // nKV
    s = torch.einsum("hd,hpd->hp", q[:, 0].double(), keys.repeat_interleave(rep, 0)) / math.sqrt(D)
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None]], dim=1)
    p = torch.softmax(s, dim=1)[:, : pos + 1 - lo]
    exact = torch.einsum("hp,hpd->hd", p, vals.repeat_interleave(rep, 0)).reshape(1, nH * D)
    if sinks is not None:
        ref = sink_attention(q, ck[:, lo : pos + 1], cv[:, lo : pos + 1], None, sinks)
    else:
        ref = F.scaled_dot_product_attention(q[None], ck[None, :, lo : pos + 1], cv[None, :, lo : pos + 1],
                                             enable_gqa=True)[0]
    return ck, cv, exact, ref.transpose(0, 1).reshape(1, nH * D)


CASES = [  # nH, nKV, D, rot, norm, clip, sinks, pos, lo
    (8, 2, 128, 128, "head", None, False, 40, 0),  # Qwen3
    (4, 4, 64, 64, "full", 0.5, False, 0, 0),  # OLMoE-like, the first position, clipped
    (8, 1, 64, 32, "none", None, False, 63, 0),  # partial rotary, one kv head, the last position
    (4, 2, 64, 64, "none", None, True, 50, 31),  # gpt-oss: sinks, a sliding window of 20
]


@pytest.mark.parametrize("nH,nKV,D,rot,norm,clip,sinks,pos,lo", CASES)
def test_decode_attention_is_the_torch_steps(nH, nKV, D, rot, norm, clip, sinks, pos, lo):
    q, k, v, (qn, kn), cos, sin, ck, cv = _case(nH, nKV, D, rot, norm, pos)
    sk = (torch.randn(nH, generator=torch.Generator().manual_seed(1)) * 3).bfloat16().float() if sinks else None
    want_k, want_v, exact, ref = _torch_attention(q, k, v, norm, qn, kn, cos, sin, ck, cv, pos, lo, clip, sk,
                                                  nH, nKV, D)
    layer = DecodeAttention(nH, nKV, D, cos, sin).layer(ck, cv, norm=norm, q_norm=qn, k_norm=kn, eps=1e-6,
                                                        clip=clip, sinks=sk)
    out = layer(q.clone(), k.clone(), v.clone(), pos, lo)
    # the cache holds what the torch steps write, bitwise (the same norm and rope functions)
    assert torch.equal(ck, want_k) and torch.equal(cv, want_v)
    # one rounding of a float32 computation: within one bf16 step of the exact attention of the same q and cache
    ulp = torch.pow(2.0, torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    assert ((out.double() - exact).abs() <= ulp).all()
    # and torch's own bf16 attention (which rounds its probabilities to bf16) is within its rounding of both
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    # the portable loops give the same bits
    ck2, cv2 = ck.clone(), cv.clone()
    layer2 = DecodeAttention(nH, nKV, D, cos, sin, path=native.PORTABLE).layer(
        ck2, cv2, norm=norm, q_norm=qn, k_norm=kn, eps=1e-6, clip=clip, sinks=sk)
    assert torch.equal(layer2(q.clone(), k.clone(), v.clone(), pos, lo), out)


@pytest.mark.parametrize("norm", ["head", "full"])
def test_zero_centred_norms_and_the_gate_are_the_torch_steps(norm):
    """Gated attention (Qwen3-Next, Qwen3.5): zero-centred q / k norms (1 + weight in float32, one rounding: the
    cache is the torch steps' bitwise, the attention within one bf16 step of the exact one) and the heads times
    sigmoid(gate) after: each element within one bf16 step of torch's `o * torch.sigmoid(gate)` on the same
    attention (the sigmoid's exp is exp_poly, 2 ulp, against torch's 1: a rounding may land the other way), most of
    them its bits; every path the same bits."""
    nH, nKV, D, rot, pos = 8, 2, 64, 16, 40  # a quarter of each head rotary
    q, k, v, (qn, kn), cos, sin, ck, cv = _case(nH, nKV, D, rot, norm, 11)
    qn, kn = (qn.float() * 0.05).bfloat16(), (kn.float() * 0.05).bfloat16()  # zero-centred: near 0
    gate = (torch.randn(1, nH * D, generator=torch.Generator().manual_seed(3)) * 3).bfloat16()
    want_k, want_v, exact, _ = _torch_attention(q, k, v, norm, qn, kn, cos, sin, ck, cv, pos, 0, None, None, nH,
                                                nKV, D, zero_centred=True)

    def run(path, g):
        c = (ck.clone(), cv.clone())
        layer = DecodeAttention(nH, nKV, D, cos, sin, path=path).layer(*c, norm=norm, q_norm=qn, k_norm=kn, eps=1e-6,
                                                                       zero_centred=True)
        return layer(q.clone(), k.clone(), v.clone(), pos, 0, g), c

    plain, (ck1, cv1) = run(native.BEST, None)
    assert torch.equal(ck1, want_k) and torch.equal(cv1, want_v)
    ulp = lambda x: torch.pow(2.0, torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)  # noqa: E731
    assert ((plain.double() - exact).abs() <= ulp(exact)).all()
    gated, _ = run(native.BEST, gate)
    ref = plain * torch.sigmoid(gate)
    assert ((gated.double() - ref.double()).abs() <= ulp(ref.double())).all()
    assert (gated != ref).float().mean() < 0.02
    same_bits(on_each(lambda path: run(path, gate)[0]))


def test_decode_attention_splits_long_contexts_over_threads_with_the_same_bits():
    nH, nKV, D, pos = 8, 2, 128, P - 1
    q, k, v, (qn, kn), cos, sin, ck, cv = _case(nH, nKV, D, D, "head", 7)
    outs = []
    for threads in (1, 2):
        native.set_threads(threads)
        try:
            layer = DecodeAttention(nH, nKV, D, cos, sin).layer(ck.clone(), cv.clone(), norm="head", q_norm=qn,
                                                                k_norm=kn, eps=1e-6)
            outs.append(layer(q.clone(), k.clone(), v.clone(), pos, 0))
        finally:
            native.set_threads(1)
    assert nH * (pos + 1) * D >= 65536  # past decode.c's threshold for the pool
    assert torch.equal(outs[0], outs[1])


def test_decode_attention_rejects_bad_arguments():
    q, k, v, (qn, kn), cos, sin, ck, cv = _case(8, 2, 128, 128, "head", 0)
    attend = DecodeAttention(8, 2, 128, cos, sin)
    with pytest.raises(ValueError, match="norm must be one of"):
        attend.layer(ck, cv, norm="layer")
    with pytest.raises(ValueError, match="q_norm"):
        attend.layer(ck, cv, norm="full", q_norm=qn, k_norm=kn)  # [D] weights where full needs [nH * D]
    with pytest.raises(ValueError, match="caches"):
        attend.layer(ck.float(), cv.float())
    layer = attend.layer(ck, cv, norm="head", q_norm=qn, k_norm=kn)
    with pytest.raises(ValueError, match="pos"):
        layer(q, k, v, P, 0)
    with pytest.raises(ValueError, match="q: need a contiguous bf16"):
        layer(q.float(), k, v, 3, 0)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        DecodeAttention(8, 3, 128, cos, sin)


@pytest.mark.parametrize("E,k", [(64, 8), (8, 2), (128, 8)])
def test_router_probs_pick_what_torch_picks(E, k):
    g = torch.Generator().manual_seed(E + k)
    H = 256
    w = (torch.randn(E, H, generator=g) * 0.1).bfloat16()
    ties = 0
    for _ in range(50):
        x = torch.randn(1, H, generator=g).bfloat16()
        probs = router_probs_bf16(x, w)
        logits = F.linear(x, w)  # routing.softmax_topk's steps
        want = torch.softmax(logits, dim=-1, dtype=torch.float32)
        # F.linear sums in another order: a bf16 logit may be a step off, its probability about 1% off
        assert probs.dtype == torch.float32 and torch.allclose(probs, want, rtol=2e-2, atol=1e-7)
        ours = router_probs_bf16(x, w)  # deterministic
        assert torch.equal(ours, probs)
        # where the logits agree, equal ones give equal probabilities and top-k picks the same experts, ties too
        mine = torch.softmax(F.linear(x.float(), w.float()).bfloat16(), dim=-1, dtype=torch.float32)
        order = lambda p: torch.sign(p[0, :, None] - p[0, None, :])  # noqa: E731  (every pair: <, = or >)
        if torch.equal(order(mine), order(probs)):
            assert torch.equal(torch.topk(probs, k)[1], torch.topk(mine, k)[1])
        ties += int(probs[0].unique().numel() < E)
        assert torch.equal(router_probs_bf16(x, w, path=native.PORTABLE), probs)
    assert ties or E < 64  # bf16 logits of 64 experts tie often: the case above is exercised
    with pytest.raises(ValueError, match="router"):
        router_probs_bf16(x, w.float())


@pytest.mark.parametrize("E,k", [(64, 8), (8, 2), (128, 8), (512, 10), (1024, 8)])
@pytest.mark.parametrize("norm,dtype", [(True, torch.bfloat16), (False, torch.bfloat16), (True, None)])
@pytest.mark.parametrize("ties", [True, False])
def test_native_top_k_is_torch_top_k_or_defers_to_it(E, k, norm, dtype, ties, request):
    """decode.c sluice_topk_probs against routing.top_of_probs (torch.topk, the sum, the division, the cast):
    bitwise, ties included where `ties` (topk.cc: torch's own algorithms; equal probabilities among the k largest,
    at the k-th, several, as bf16 logits give them); None (the model then asks torch) for a NaN, and for those ties
    when not `ties`. (1024, 8): torch's partial_sort branch (k * 64 <= E)."""
    if ties:
        request.getfixturevalue("need_topk")
    from types import SimpleNamespace

    from sluice.models.routing import top_of_probs

    spec = SimpleNamespace(top_k=k, norm_topk_prob=norm, router_weights_fp32=dtype is None)
    g = torch.Generator().manual_seed(E + k)
    deferred = 0
    for i in range(300):
        probs = torch.softmax(torch.randn(1, E, generator=g) * 3, dim=-1)
        order = torch.argsort(probs[0], descending=True)
        if i % 6 == 1:  # a tie inside the k largest: the second equal to the first
            probs[0, order[1]] = probs[0, order[0]]
        if i % 6 == 4:  # a tie at the k-th: the next one equal to it
            probs[0, order[k]] = probs[0, order[k - 1]]
        if i % 6 == 3:  # many: the probabilities of bf16 logits (equal logits, equal probabilities)
            probs = torch.softmax(torch.randn(1, E, generator=g).bfloat16().float() * 2, dim=-1)
            order = torch.argsort(probs[0], descending=True)
            probs[0, order[: k + 2]] = probs[0, order[k]].item()
        if i == 5:
            probs[0, 3] = float("nan")
        got = topk_probs(probs, k, norm, dtype, ties=ties)
        w, ids = top_of_probs(spec, probs, torch.bfloat16)
        if got is None:
            deferred += 1
            continue
        assert torch.equal(got[1], ids) and got[0].dtype == w.dtype and torch.equal(got[0], w)
    # the NaN (and, without `ties`, the ties made above), not the rest; with norm only k = 1, 2, 4, 8 (torch's sum
    # order is known there)
    assert deferred == (300 if norm and k not in (1, 2, 4, 8) else 1 if ties else 151)


@pytest.mark.parametrize("n", [1, 2, 7, 64, 65, 256, 511, 512, 1024, 4096])
def test_topk_torch_is_torch_topk_where_values_tie(n, need_topk):
    """topk.cc against torch.topk on rows of a few distinct values (every k: ties inside the k largest, across the
    k-th, everywhere), NaNs (torch ranks them first), +-inf, -0.0 beside 0.0: the same indices in the same order
    and the same values; k out of range or a row over SLUICE_TOPK_MAX is None. ties_exact (the check the models
    run once) holds on this build."""
    from sluice.quant.native.decode import ties_exact, topk_torch

    g = torch.Generator().manual_seed(n)
    for i in range(60):
        levels = 1 + i % 9
        row = torch.randint(0, levels, (n,), generator=g).float() / levels
        if i % 5 == 2:
            row[torch.randint(0, n, (max(1, n // 50),), generator=g)] = float("nan")
        if i % 5 == 3:
            row[torch.randint(0, n, (max(1, n // 50),), generator=g)] = float("inf")
            row[torch.randint(0, n, (max(1, n // 50),), generator=g)] = -float("inf")
        if i % 5 == 4:
            row[row == 0] = torch.where(torch.rand(int((row == 0).sum()), generator=g) < 0.5, -0.0, 0.0)
        for k in sorted({min(n, k) for k in (1, 2, 8, 10, 64, n)}):
            want = torch.topk(row, k)
            got = topk_torch(row, k)
            assert torch.equal(got[1], want.indices), (n, i, k)
            nan = want.values.isnan()
            assert torch.equal(got[0].isnan(), nan) and torch.equal(got[0][~nan], want.values[~nan])
            assert torch.equal(got[0].signbit(), want.values.signbit())
    assert topk_torch(row, 0) is None and topk_torch(row, n + 1) is None and topk_torch(row, -1) is None
    assert topk_torch(torch.zeros(4097), 8) is None
    with pytest.raises(ValueError, match="float32"):
        topk_torch(row.double(), 1)
    assert ties_exact()


@pytest.mark.parametrize("path", ["avx2", "portable"])
@pytest.mark.parametrize("E,k", [(64, 8), (256, 8), (512, 10)])
def test_guess_is_the_norm_router_and_top_k_in_one_call(E, k, path):
    """decode.c sluice_guess_bf16 (a decode token's guess of the next layer, prerouter/predict.py): the k ids of
    torch.topk over router_probs_bf16 of rms_norm_scaled_bf16(x), the same bits; where the top k tie, the
    probabilities (the same as router_probs_bf16's) for torch.topk to choose; with topk.cc (`ties`), torch.topk's
    ids, ties too."""
    from sluice.quant.native import decode, ops
    from tests.quant.paths import CODES

    p = CODES[path]
    g = torch.Generator().manual_seed(E + k)
    H = 512
    w = (torch.randn(E, H, generator=g) * 0.1).bfloat16()
    scale = 1.0 + 0.1 * torch.randn(H, generator=g)
    guess = Guess(scale, 1e-6, w, k, path=p, norm_path=p, ties=False)
    tie_order = decode.ties_expected() or decode.ties_exact()  # topk.cc's order is torch's here (need_topk)
    exact = Guess(scale, 1e-6, w, k, path=p, norm_path=p, ties=True) if tie_order else None
    tied = 0
    for i in range(40):
        x = (torch.randn(1, H, generator=g) * (1 + i)).bfloat16()
        probs = router_probs_bf16(ops.rms_norm_scaled_bf16(x, scale, 1e-6, path=p), w, path=p)
        if exact is not None:
            assert exact(x) == torch.topk(probs, k)[1][0].tolist()  # ties too: torch's choice
        got = guess(x)
        if isinstance(got, torch.Tensor):  # a tie: torch.topk decides, on the same probabilities
            tied += 1
            assert torch.equal(got, probs)
            continue
        assert got == torch.topk(probs, k)[1][0].tolist()
    assert 0 < tied < 40  # the ties both guesses met: bf16 logits of this router tie
    with pytest.raises(ValueError, match="scale"):
        Guess(scale.bfloat16(), 1e-6, w, k)
    with pytest.raises(ValueError, match="k must be"):
        Guess(scale, 1e-6, w, 65)
