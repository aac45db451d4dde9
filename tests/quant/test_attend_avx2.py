"""A prompt's causal attention in float32 (sluice/quant/native/attend_avx2.c: float32 products and probabilities, on
AVX2 + FMA or its portable twin), for CPUs whose prompt GEMMs are float32 (no AVX512_BF16, or --isa avx2 / portable).

Against a float64 reference it is at least as close as torch's SDPA on the same bf16 inputs (the attention such a
model ran before); a later chunk (pos > 0) sees the cache before it; grouped-query heads read their kv head; any
thread count, query stride and path (AVX2, portable) gives the same bits; in a model capped at AVX2 a prompt takes it, its logits stay near
SDPA's, and a streamed run gives the resident run's bits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sluice
from sluice.models.layers import Kernels
from sluice.quant.native import attend, pool
from tests.models.tiny import hf_model, write_checkpoint
from tests.quant import paths
from tests.quant.streaming import assert_streamed_equals_resident
from tests.quant.test_attend import case, reference, rel

pytestmark = pytest.mark.skipif(not attend.available(float32=True),
                                reason="native kernels not built (pip install -e . with a C compiler builds them)")


def sdpa_bf16(q, k, v, pos: int) -> torch.Tensor:
    """torch's SDPA on the bf16 inputs themselves: what a model on float32 GEMMs ran before attend_avx2.c."""
    T = q.shape[1]
    mask = torch.ones(T, pos + T, dtype=torch.bool).tril(pos)
    out = F.scaled_dot_product_attention(q[None], k[None, :, : pos + T], v[None, :, : pos + T], attn_mask=mask,
                                         enable_gqa=True)[0]
    return out.transpose(0, 1).reshape(T, -1)


@pytest.mark.parametrize("T, pos, nh, nkv, d", [(300, 0, 8, 2, 128), (37, 50, 4, 4, 64), (65, 130, 16, 1, 96),
                                                (1, 7, 4, 2, 32), (129, 0, 6, 3, 256), (70, 0, 2, 2, 512)])
def test_at_least_as_close_as_sdpa_to_the_exact_attention(T, pos, nh, nkv, d):
    q, k, v = case(T, pos, nh, nkv, d)
    exact = reference(q, k, v, pos)
    got = attend.causal(q, k, v, pos, float32=True)
    assert got.shape == (T, nh * d) and got.dtype == torch.bfloat16
    # the output's own bf16 rounding is most of either error (~1.6e-3 here)
    err, theirs = rel(got, exact), rel(sdpa_bf16(q, k, v, pos), exact)
    assert err <= max(2e-3, 1.02 * theirs), (err, theirs)


@pytest.mark.parametrize("T, pos, nh, nkv, d", [(100, 20, 8, 2, 128), (70, 0, 4, 1, 64), (9, 60, 2, 2, 32)])
def test_the_portable_twin_gives_the_avx2_bits(T, pos, nh, nkv, d):
    q, k, v = case(T, pos, nh, nkv, d, seed=4)
    k[0, 3, 5] = float("nan")  # a NaN key: every row that sees it
    outs = paths.on_each(lambda path: attend.causal(q, k, v, pos, float32=True, path=path), ["avx2", "portable"])
    assert outs[0].isnan().any() and not outs[0][: max(0, 3 - pos)].isnan().any()
    paths.same_bits([o.view(torch.int16) for o in outs])  # bit patterns: NaN rows compare too


def test_strided_queries_and_thread_counts_give_the_same_bits():
    q, k, v = case(100, 20, 8, 2, 128, seed=1)
    old = pool.threads()
    try:
        pool.set_threads(1)
        one = attend.causal(q, k, v, 20, float32=True)
        pool.set_threads(2)
        assert torch.equal(attend.causal(q, k, v, 20, float32=True), one)
    finally:
        pool.set_threads(old)
    wide = torch.zeros(100, 8, 256, dtype=torch.bfloat16)  # q as a [T, nH, D] slice, viewed [nH, T, D]
    wide[..., :128] = q.transpose(0, 1)
    assert torch.equal(attend.causal(wide[..., :128].transpose(0, 1), k, v, 20, float32=True), one)
    # a query row depends on the keys before it only: the first 40 rows alone are the same
    assert torch.equal(attend.causal(q[:, :40], k, v, 20, float32=True), one[:40])


def test_a_nan_stays_in_its_rows():
    q, k, v = case(40, 0, 4, 2, 64, seed=2)
    clean = attend.causal(q, k, v, 0, float32=True)
    bad = q.clone()
    bad[1, 7, 3] = float("nan")  # head 1, position 7
    got = attend.causal(bad, k, v, 0, float32=True).view(40, 4, 64)
    assert got[7, 1].isnan().all()
    keep = torch.ones(40, 4, dtype=torch.bool)
    keep[7, 1] = False
    assert torch.equal(got[keep], clean.view(40, 4, 64)[keep])


def test_bad_arguments_are_named():
    q, k, v = case(8, 0, 4, 2, 64)
    with pytest.raises(ValueError, match="q must be a CPU bf16"):
        attend.causal(q.float(), k, v, 0, float32=True)
    with pytest.raises(ValueError, match=r"k must be a bf16 cache \[nKV, >= 20"):
        attend.causal(q, k, v, 12, float32=True)
    with pytest.raises(ValueError, match="unsupported heads"):
        attend.causal(*case(8, 0, 4, 2, 48), 0, float32=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    model = hf_model("qwen3_moe", head_dim=32)
    return write_checkpoint(model, tmp_path_factory.mktemp("att2") / "m", "per_expert")


IDS = torch.randint(0, 300, (90,), generator=torch.Generator().manual_seed(3)).tolist()


def test_a_capped_prompt_takes_it_and_streams_bitwise(folder, monkeypatch):
    calls = []
    real = attend.causal
    monkeypatch.setattr(attend, "causal", lambda *a: calls.append((a[3], a[4])) or real(*a))
    with sluice.load(folder, memory="all", prefill_chunk=32, dtype="bfloat16", isa="avx2") as m:
        fast = m.logits(IDS)
        assert calls and set(calls) == {(0, True), (32, True), (64, True)}  # every chunk, the float32 kernel
        m.model = m.model.rebuilt(Kernels(native_prompt_attention=False))
        calls.clear()
        slow = m.logits(IDS)
        assert not calls
    # the same attention up to float32 sums and torch's bf16 roundings, through a random model's layers
    assert rel(fast, slow) <= 3e-2
    assert_streamed_equals_resident(folder, IDS, "direct", False, "min", prefill_chunk=32, dtype="bfloat16",
                                    isa="avx2")
