"""A decode token's MoE block in two native calls (native/moe_decode.c, models/layers/moe_decode.py): each call is
the composition of the calls the block made one by one, so each must give their bits.

- DecodeRoute: router_probs_bf16 then topk_probs (decode.c), the ids also ascending with their positions; False
  where topk_probs defers to torch (a NaN, a tie without topk.cc), the probabilities written;
- DecodeExperts.run: ExpertCall.many (q8.c) on the experts and the shared one, then ops.combine_bf16 in id order
  and the shared term last, in one call or in several (the experts in memory first, the late ones as they land);
- shared_weight: torch.sigmoid(F.linear(x, gate)) in bf16, up to the dot's order (a bf16 step at most).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.quant import native
from sluice.quant.native import ops, pool, q8
from sluice.quant.native.decode import router_probs_bf16, topk_probs
from sluice.quant.spec import QuantSpec
from tests.quant import paths
from tests.quant.samples import random_expert_slots, random_stored

pytestmark = pytest.mark.skipif(not native.available(), reason="the native extension is not built")

if native.available():
    from sluice.quant.native.moe_decode import DecodeExperts, DecodeRoute, shared_weight


@pytest.mark.parametrize("path", paths.PATHS)
@pytest.mark.parametrize("E,k,norm,bf16w", [(64, 8, True, True), (256, 8, False, True), (128, 4, True, False),
                                            (8, 2, False, False)])
def test_route_is_the_router_and_top_k_in_one_call(E, k, norm, bf16w, path):
    p = paths.code(path)
    g = torch.Generator().manual_seed(E + k)
    H = 512
    w = (torch.randn(E, H, generator=g) * 0.1).bfloat16()
    route = DecodeRoute(w, k, norm, bf16w, ties=False, path=p)
    deferred = 0
    for i in range(60):
        x = (torch.randn(1, H, generator=g) * (1 + i % 7)).bfloat16()
        if i == 7:
            x[0, 3] = float("nan")
        probs = router_probs_bf16(x, w, path=p)
        want = topk_probs(probs, k, norm, torch.bfloat16 if bf16w else None, ties=False)
        got = route(x)
        assert torch.equal(route.probs, probs) or (probs.isnan().all() and route.probs.isnan().all())
        if want is None:  # torch decides: the route says so, with the probabilities written
            deferred += 1
            assert not got
            continue
        assert got
        weights, ids = want
        assert torch.equal(route.ids, ids) and torch.equal(route.weights, weights)
        assert route.weights.dtype == (torch.bfloat16 if bf16w else torch.float32)
        ids_l = ids[0].tolist()
        assert route.sorted_ids() == sorted(ids_l)
        assert [ids_l[j] for j in route.at.tolist()] == sorted(ids_l)
    assert 1 <= deferred < 60  # the NaN, and ties of bf16 logits without topk.cc
    with pytest.raises(ValueError, match="k must be"):
        DecodeRoute(w, 0, norm, bf16w)
    with pytest.raises(ValueError, match="router"):
        DecodeRoute(w.float(), k, norm, bf16w)


def test_route_orders_ties_as_torch_does_with_topk_cc(need_topk):
    from types import SimpleNamespace

    from sluice.models.routing import top_of_probs

    g = torch.Generator().manual_seed(1)
    E, H, k = 256, 128, 8
    w = (torch.randn(E, H, generator=g) * 0.02).bfloat16()  # small logits: many equal in bf16
    route = DecodeRoute(w, k, True, True, ties=True)
    spec = SimpleNamespace(top_k=k, norm_topk_prob=True, router_weights_fp32=False)
    tied = 0
    for _ in range(40):
        x = torch.randn(1, H, generator=g).bfloat16()
        assert route(x)
        weights, ids = top_of_probs(spec, route.probs, torch.bfloat16)
        assert torch.equal(route.ids, ids) and torch.equal(route.weights, weights)
        tied += int(route.probs[0].unique().numel() < E)
    assert tied


_KEEP: list = []


def _layer(n: int, seed: int = 0):
    """A layer's expert format (Q4_K gate and up [256, 512], Q6_K down), n random experts in slots, its call, and a
    shared expert of the same shape as three tensors (expert_args)."""
    from sluice.store.layout import ExpertFormat

    H, I = 512, 256
    specs = (QuantSpec.ggml("Q4_K", I, H), QuantSpec.ggml("Q4_K", I, H), QuantSpec.ggml("Q6_K", H, I))
    fmt = ExpertFormat.of(*specs)
    raw = random_expert_slots(fmt, n, seed=seed)
    call = q8.ExpertCall(specs, (0, fmt.up_offset, fmt.down_offset))
    shared_raws = tuple(random_stored(s, seed=seed + 100 + j) for j, s in enumerate(specs))
    _KEEP.append(shared_raws)  # expert_args' addresses are good while these live
    return raw, call, q8.expert_args(specs, shared_raws)[2], H


def _want(call, raw, slots, x, w, at, extra, gate, path):
    """The block's one-token sum the way layers/moe.py made it: ExpertCall.many (the shared expert as its extra),
    ops.combine_bf16 in id order from zeros, the shared term last."""
    k, H = len(slots), x.shape[1]
    ys = torch.empty(k + 1, H)
    call.many(raw, slots, x.float(), ys, list(range(k)), path=path, extra=None if extra is None else (extra, k))
    out = torch.zeros(1, H, dtype=torch.bfloat16)
    ops.combine_bf16(ys[:k], w, at, out, path=path)
    if extra is not None:
        sw = torch.ones(1, 1, dtype=torch.bfloat16) if gate is None else shared_weight(x, gate, path=path)
        ops.combine_bf16(ys[k:], sw, [0], out, path=path)
    return out


@pytest.fixture
def c_threads():
    """pool.set_threads(n) for the test (the C pool), back to one thread after it."""
    yield pool.set_threads
    pool.set_threads(1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shared", ["none", "ungated", "gated"])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_experts_and_sum_are_the_calls_they_replace(shared, wdtype, threads, c_threads):
    """In one call, in several (the experts in memory first, the late ones as they land, the shared expert alone
    when none is in memory), and started on the pool's workers then finished (start / finish, with another pool
    job from the same thread in between: on one thread the pool cannot start a job and start runs it): each gives
    the block's one-token sum as moe.py computed it, on each C path."""
    c_threads(threads)
    raw, call, extra, H = _layer(7)
    g = torch.Generator().manual_seed(2)
    router = (torch.randn(64, H, generator=g) * 0.1).bfloat16()
    gate = (torch.randn(1, H, generator=g) * 0.05).bfloat16() if shared == "gated" else None
    extra = None if shared == "none" else extra
    k = 4
    every = []
    for path in paths.distinct():
        p = paths.code(path)
        ex = DecodeExperts(call, extra, gate, k, 2, path=p)
        ex.check_raw(raw)
        outs = []
        g.manual_seed(3)  # the same tokens on each path
        for i in range(6):
            x = torch.randn(1, H, generator=g).bfloat16()
            slots = sorted(torch.randperm(7, generator=g)[:k].tolist())
            w = torch.softmax(torch.randn(1, k, generator=g), -1).to(wdtype)
            at = torch.randperm(k, generator=g)  # each row's weight position (the ids' rank by probability)
            want = _want(call, raw, slots, x, w, at.tolist(), extra, gate, p)
            out = torch.empty(1, H, dtype=torch.bfloat16)
            ex.run(raw, slots, list(range(k)), x, True, True, k, w, at, out)  # every expert in memory
            assert torch.equal(out, want), (path, i)
            # in memory first (rows 1 and 3), then each late one in a call of its own, the sum with the last; the
            # shared expert in the first call
            split = torch.full((1, H), float("nan")).bfloat16()
            ex.run(raw, [slots[1], slots[3]], [1, 3], x, True, True)
            ex.run(raw, [slots[0]], [0], x, False, False)
            ex.run(raw, [slots[2]], [2], x, False, False, k, w, at, split)
            assert torch.equal(split, want), (path, i)
            # nothing in memory: the shared expert alone first
            none = torch.empty(1, H, dtype=torch.bfloat16)
            ex.run(raw, [], [], x, True, True)
            ex.run(raw, slots, list(range(k)), x, False, False, k, w, at, none)
            assert torch.equal(none, want), (path, i)
            # started on the pool's workers, another pool job from this thread meanwhile (it runs on this thread),
            # then finished
            started = torch.empty(1, H, dtype=torch.bfloat16)
            ex.start(raw, slots, x, w, at, started)
            with pytest.raises(RuntimeError, match="has not finished"):
                ex.start(raw, slots, x, w, at, started)
            probs = router_probs_bf16(x, router, path=p)
            ex.finish()
            ex.finish()  # nothing left: a no-op
            assert torch.equal(started, want), (path, i)
            assert torch.equal(probs, router_probs_bf16(x, router, path=p))
            outs.append(out)
        every.append(outs)
    paths.same_bits(every)


def test_the_shared_weight_is_torch_sigmoid_of_the_gate_to_a_bf16_step():
    g = torch.Generator().manual_seed(4)
    H = 512
    same = 0
    for i in range(200):
        gate = (torch.randn(1, H, generator=g) * 0.05).bfloat16()
        x = (torch.randn(1, H, generator=g) * (1 + i % 5)).bfloat16()
        want = torch.sigmoid(F.linear(x, gate))
        for p in paths.distinct():
            got = shared_weight(x, gate, path=paths.code(p))
            assert got.dtype == torch.bfloat16 and got.shape == (1, 1)
            # the dot's order differs from F.linear's: its bf16 rounding may land a step away, and the sigmoid's
            # slope is at most 1/4
            assert (got.float() - want.float()).abs().item() <= 2 ** -8 * max(1.0, abs(want.item())), (i, got, want)
        same += int(torch.equal(got, want))
    assert same >= 180


def test_bad_arguments_are_named():
    raw, call, extra, H = _layer(3)
    with pytest.raises(ValueError, match="k must be"):
        DecodeExperts(call, extra, None, 65, 2)
    with pytest.raises(ValueError, match="9 call values"):
        DecodeExperts(call, extra[:6], None, 2, 2)
    with pytest.raises(ValueError, match="shared gate"):
        DecodeExperts(call, extra, torch.randn(1, H), 2, 2)
    ex = DecodeExperts(call, extra, None, 2, 2)
    with pytest.raises(ValueError, match="expert slots"):
        ex.check_raw(raw[:, :-1])
    with pytest.raises(ValueError, match="expert slots"):
        ex.check_raw(raw.view(torch.int8))
    ex.check_raw(raw)
    x = torch.randn(1, H).bfloat16()
    with pytest.raises(ValueError, match="at most 2"):
        ex.run(raw, [0, 1, 2], [0, 1, 2], x, True, True)
    with pytest.raises(ValueError, match="the sum needs"):
        ex.run(raw, [0, 1], [0, 1], x, True, True, 2, torch.ones(1, 2, dtype=torch.float16), torch.arange(2),
               torch.empty(1, H, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x: need"):
        ex.run(raw, [0, 1], [0, 1], x.float(), True, True)
