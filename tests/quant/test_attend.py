"""A prompt's causal attention in one native call (sluice/quant/native/attend.c, CPUs with AVX512_BF16).

Against a float64 reference it is as close as matmul.sdpa, which the model runs otherwise (both multiply bf16
values exactly and round the probabilities to bf16: relative error ~1.7e-3 on these random inputs, bound 2.5e-3 and
1.3x sdpa's); a later chunk (pos > 0) sees the cache before it; grouped-query heads read their kv head; any thread
count gives the same bits; in a model, a prompt takes it and a streamed run still gives the resident run's bits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sluice
from sluice.quant.matmul import sdpa
from sluice.models.layers import Kernels
from sluice.quant.native import attend, pool
from tests.models.tiny import hf_model, write_checkpoint
from tests.quant.streaming import assert_streamed_equals_resident

pytestmark = pytest.mark.skipif(not attend.available(), reason="needs the native extension and AVX512_BF16")


def case(T: int, pos: int, nh: int, nkv: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    p = pos + T + 5  # a cache longer than the positions in use
    q = (torch.randn(nh, T, d, generator=g) * 2).bfloat16()
    k = (torch.randn(nkv, p, d, generator=g) * 2).bfloat16()
    v = torch.randn(nkv, p, d, generator=g).bfloat16()
    return q, k, v


def reference(q, k, v, pos: int, dtype=torch.float64) -> torch.Tensor:
    T = q.shape[1]
    mask = torch.ones(T, pos + T, dtype=torch.bool).tril(pos)
    kk, vv = k[:, : pos + T], v[:, : pos + T]
    if dtype is torch.bfloat16:  # what the model runs without attend.c
        out = sdpa(q[None], kk[None], vv[None], True, attn_mask=mask, enable_gqa=True)[0]  # on bf16 GEMMs
    else:
        out = F.scaled_dot_product_attention(q[None].to(dtype), kk[None].to(dtype), vv[None].to(dtype),
                                             attn_mask=mask, enable_gqa=True)[0]
    return out.transpose(0, 1).reshape(T, -1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("T, pos, nh, nkv, d", [(300, 0, 8, 2, 128), (37, 50, 4, 4, 64), (65, 130, 16, 1, 96),
                                                (1, 7, 4, 2, 32), (129, 0, 6, 3, 256)])
def test_as_close_as_sdpa_to_the_exact_attention(T, pos, nh, nkv, d):
    q, k, v = case(T, pos, nh, nkv, d)
    exact = reference(q, k, v, pos)
    got = attend.causal(q, k, v, pos)
    assert got.shape == (T, nh * d) and got.dtype == torch.bfloat16
    err, theirs = rel(got, exact), rel(reference(q, k, v, pos, torch.bfloat16), exact)
    assert err <= max(2.5e-3, 1.3 * theirs), (err, theirs)


def test_strided_queries_and_thread_counts_give_the_same_bits():
    q, k, v = case(100, 20, 8, 2, 128, seed=1)
    old = pool.threads()
    try:
        pool.set_threads(1)
        one = attend.causal(q, k, v, 20)
        pool.set_threads(2)
        assert torch.equal(attend.causal(q, k, v, 20), one)
    finally:
        pool.set_threads(old)
    wide = torch.zeros(100, 8, 256, dtype=torch.bfloat16)  # q as a [T, nH, D] slice, viewed [nH, T, D]
    wide[..., :128] = q.transpose(0, 1)
    assert torch.equal(attend.causal(wide[..., :128].transpose(0, 1), k, v, 20), one)
    # a query row depends on the keys before it only: the first 40 rows alone are the same
    assert torch.equal(attend.causal(q[:, :40], k, v, 20), one[:40])


def test_a_nan_stays_in_its_rows():
    """A NaN in q makes its row's output NaN, as SDPA's (exp_poly16 alone would clamp it into a number); the other
    rows keep their values."""
    q, k, v = case(40, 0, 4, 2, 64, seed=2)
    clean = attend.causal(q, k, v, 0)
    bad = q.clone()
    bad[1, 7, 3] = float("nan")  # head 1, position 7
    got = attend.causal(bad, k, v, 0).view(40, 4, 64)
    assert got[7, 1].isnan().all()
    keep = torch.ones(40, 4, dtype=torch.bool)
    keep[7, 1] = False
    assert torch.equal(got[keep], clean.view(40, 4, 64)[keep])


def test_bad_arguments_are_named():
    q, k, v = case(8, 0, 4, 2, 64)
    with pytest.raises(ValueError, match="q must be a CPU bf16"):
        attend.causal(q.float(), k, v, 0)
    with pytest.raises(ValueError, match=r"k must be a bf16 cache \[nKV, >= 20"):
        attend.causal(q, k, v, 12)
    with pytest.raises(ValueError, match="unsupported heads"):
        attend.causal(q[:3], k, v, 0)
    with pytest.raises(ValueError, match="q must be a CPU bf16"):
        attend.causal(torch.empty(4, 8, 64, dtype=torch.bfloat16, device="meta"), k, v, 0)
    with pytest.raises(ValueError, match="same kv heads and head stride"):
        attend.causal(q, k, v[:1], 0)
    assert attend.causal(q[:, :0], k, v, 0).shape == (0, 4 * 64)
    with pytest.raises(ValueError, match="unsupported heads"):
        attend.causal(*case(8, 0, 4, 2, 48), 0)
    assert attend.supports(64, 8, 128) and not attend.supports(64, 2, 128) and not attend.supports(8, 2, 80)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    model = hf_model("qwen3_moe", head_dim=32)
    return write_checkpoint(model, tmp_path_factory.mktemp("att") / "m", "per_expert")


IDS = torch.randint(0, 300, (90,), generator=torch.Generator().manual_seed(3)).tolist()


def test_a_prompt_takes_it_and_streams_bitwise(folder, monkeypatch):
    calls = []
    real = attend.causal
    monkeypatch.setattr(attend, "causal", lambda *a: calls.append(a[3]) or real(*a))
    monkeypatch.setattr("sluice.engine.amx_bf16", lambda: False)  # as on a CPU without AMX (the next test: with)
    with sluice.load(folder, memory="all", prefill_chunk=32, dtype="bfloat16") as m:
        assert m.model.spec.head_dim == 32
        fast = m.logits(IDS)
        assert calls and set(calls) == {0, 32, 64}  # every chunk's layers: later chunks read the cache before them
        m.model = m.model.rebuilt(Kernels(native_prompt_attention=False))
        calls.clear()
        slow = m.logits(IDS)
        assert not calls
    # the same attention up to float32 sums and bf16 roundings, through a random model's layers
    assert rel(fast, slow) <= 3e-2
    assert_streamed_equals_resident(folder, IDS, "direct", False, "min", prefill_chunk=32, dtype="bfloat16")


def test_a_cpu_with_amx_keeps_torchs_attention(folder, monkeypatch):
    """With AMX tiles torch's flash attention is the faster one (quant/compute.py attend_prompt): attend.c is not
    called, and the prompt's logits stay within bf16 rounding of attend.c's."""
    calls = []
    real = attend.causal
    monkeypatch.setattr(attend, "causal", lambda *a: calls.append(a[3]) or real(*a))
    monkeypatch.setattr("sluice.engine.amx_bf16", lambda: True)
    with sluice.load(folder, memory="all", prefill_chunk=32, dtype="bfloat16") as m:
        torch_ = m.logits(IDS)
    monkeypatch.setattr("sluice.engine.amx_bf16", lambda: False)
    with sluice.load(folder, memory="all", prefill_chunk=32, dtype="bfloat16") as m:
        native = m.logits(IDS)
    assert len(calls) > 0 and len(calls) == len(set(calls)) * m.spec.n_layers  # only the second model's
    assert torch.allclose(torch_, native, atol=0.05 * native.abs().max().item())
