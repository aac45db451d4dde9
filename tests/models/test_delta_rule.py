"""The gated delta rule (models/layers/delta_rule.py) against transformers' reference functions on random inputs
(float32) and against the rule written out token by token (float64): both forms, with fewer key heads than value
heads, from a carried state, over prompts shorter and longer than a block, and the state carried across split
prompts and decode steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.models.layers import delta_rule

reference = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next",
                                reason="transformers' Qwen3-Next is the reference")

NK, HV, DK, DV = 2, 4, 16, 8  # two value heads per key head; key and value dims differ
# relative to the output's largest value: the reference computes in float32 whatever its inputs, so float32 is
# compared with it to a few ulps of the state's sums; float64 is compared with the rule written out token by token
# (`plain`) to float64 rounding, and with the reference to float32's
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}


def inputs(T: int, dtype: torch.dtype, seed: int = 0):
    """q, k [T, NK, DK], v [T, HV, DV], g, beta [T, HV] as a Gated DeltaNet layer makes them (g = -exp(A) *
    softplus(a + dt_bias) < 0, beta = sigmoid(b)), and a random non-zero starting state."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(T, NK, DK), r(T, NK, DK), r(T, HV, DV)
    g = -r(HV).exp() * F.softplus(r(T, HV) + 1.0)
    beta = torch.sigmoid(r(T, HV))
    state = 0.3 * r(HV, DK, DV)
    return tuple(t.to(dtype) for t in (q, k, v, g, beta, state))


def ref(form: str, q, k, v, g, beta, state):
    """The reference's output [T, HV, DV] and final state [HV, DK, DV] (batch of one; float32 inside)."""
    fn = reference.torch_chunk_gated_delta_rule if form == "chunked" else reference.torch_recurrent_gated_delta_rule
    out, final = fn(q[None], k[None], v[None], g[None], beta[None], initial_state=state[None],
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], final[0]


def plain(q, k, v, g, beta, state):
    """The rule as the paper writes it, one token and one head at a time, in float64: the oracle for float64."""
    r = HV // NK
    S = state.clone()
    out = torch.empty(q.shape[0], HV, DV, dtype=torch.float64)
    for t in range(q.shape[0]):
        for h in range(HV):
            qt, kt = (x[t, h // r] / x[t, h // r].pow(2).sum().add(1e-6).sqrt() for x in (q, k))
            S[h] *= g[t, h].exp()
            u = beta[t, h] * (v[t, h] - kt @ S[h])
            S[h] += torch.outer(kt, u)
            out[t, h] = (qt / DK**0.5) @ S[h]
    return out, S


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    err = (a - b).abs().max().item() / b.abs().max().item()
    assert err <= TOL[dtype], err


@pytest.mark.parametrize("T", [1, 7, 64, 150])
@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_each_form_matches_the_reference_in_float32(form, T):
    q, k, v, g, beta, state = inputs(T, torch.float32)
    want, want_state = ref(form, q, k, v, g, beta, state)
    s = state.clone()
    got = getattr(delta_rule, form)(q, k, v, g, beta, s)
    assert got.dtype == torch.float32 and got.shape == (T, HV, DV)
    close(got, want, torch.float32)
    close(s, want_state, torch.float32)


@pytest.mark.parametrize("T", [1, 7, 64, 150])
@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_each_form_is_the_rule_in_float64(form, T):
    q, k, v, g, beta, state = inputs(T, torch.float64, seed=T)
    want, want_state = plain(q, k, v, g, beta, state)
    s = state.clone()
    got = getattr(delta_rule, form)(q, k, v, g, beta, s)
    assert got.dtype == torch.float64
    close(got, want, torch.float64)
    close(s, want_state, torch.float64)
    ref_out, ref_state = ref(form, q, k, v, g, beta, state)  # float32 inside: float32's agreement
    close(ref_out.double(), want, torch.float32)
    close(ref_state.double(), want_state, torch.float32)


def test_chunked_and_recurrent_are_one_rule_and_the_state_carries():
    """A 150-token prompt in one call, split at 37 and 101 (blocks not aligned), or token by token: the same
    outputs and final state (float64, so only the forms' rounding differs)."""
    q, k, v, g, beta, state = inputs(150, torch.float64, seed=3)
    whole_state = state.clone()
    whole = delta_rule.chunked(q, k, v, g, beta, whole_state)
    split_state, parts = state.clone(), []
    for a, b in ((0, 37), (37, 101), (101, 150)):
        parts.append(delta_rule.chunked(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], split_state))
    step_state = state.clone()
    steps = [delta_rule.recurrent(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1],
                                  step_state) for t in range(150)]
    for other, other_state in ((torch.cat(parts), split_state), (torch.cat(steps), step_state)):
        close(other, whole, torch.float64)
        close(other_state, whole_state, torch.float64)


def test_bf16_inputs_run_the_state_in_float32():
    q, k, v, g, beta, state = inputs(70, torch.float32, seed=5)
    s16 = state.clone()
    out = delta_rule.chunked(*(t.to(torch.bfloat16) for t in (q, k, v)), g, beta.to(torch.bfloat16), s16)
    want, want_state = ref("chunked", *(t.to(torch.bfloat16) for t in (q, k, v)), g, beta.to(torch.bfloat16), state)
    assert out.dtype == torch.bfloat16 and s16.dtype == torch.float32
    assert (out.float() - want.float()).abs().max().item() <= 1e-2 * want.float().abs().max().item()
    close(s16, want_state, torch.float32)
