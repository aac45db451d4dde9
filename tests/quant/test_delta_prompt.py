"""A prompt's gated delta rule in one native call (native/delta_prompt.py, delta_prompt.c) against delta_rule.chunked
(the torch steps it replaces), transformers' torch_chunk_gated_delta_rule and a float64 run of chunked, on each kernel
(portable, AVX2, AVX-512: tests/quant/paths.py runs every one this CPU has): prompts shorter than a block, across
blocks with a tail, in several calls carrying the state, key heads grouped and tiled; and in a model: Build chooses it
once, its logits are the torch rule's to float32 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sluice
from sluice.models.layers import delta_rule
from sluice.models.layers.build import Kernels
from sluice.quant import native
from sluice.quant.native.delta_prompt import DeltaRulePrompt
from sluice.quant.native.deltanet import KERNELS, DeltaNetDecode
from tests.quant.paths import on_each, same_bits

pytestmark = pytest.mark.skipif(not native.native_available(),
                                reason="native kernels not built (pip install -e . with a C compiler builds them)")

# nK, Hv, Dk, Dv: Qwen3.6-35B-A3B's linear attention (16 key heads, 32 value heads, 128 x 128), four value heads a key
# head with value heads of 60 columns (AVX-512's 16- and 8-column tiles and a 4-column tail), one a key head with
# Dk 24 (a 16- and an 8-column key block) and Dv 36
SHAPES = [(16, 32, 128, 128), (2, 8, 16, 60), (3, 3, 24, 36)]
# relative to the output's (state's) largest value: float32 chunked and the native rule both stay within ~2e-6 of
# the float64 run (measured: see test_float32_is_chunked_to_float32_rounding); a wrong order of operations (a decay
# applied once too often or not at all, the solve's rows out of order, q unscaled) is >= 1e-2 here
BOUND = 1e-5


def _case(shape, T: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    """q, k [T, nK, Dk], v [T, Hv, Dv], beta [T, Hv] in dtype; g [T, Hv] float32 as a layer makes them (value head 0:
    g ~ -20 a token, so a block's decays reach e^-1280: exp_poly's clamp at -87); a non-zero float32 state."""
    nK, Hv, Dk, Dv = shape
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(T, nK, Dk), r(T, nK, Dk), r(T, Hv, Dv)
    g = -r(Hv).exp() * F.softplus(r(T, Hv) + 1.0)
    g[:, 0] = -20.0 - r(T).abs()
    beta = torch.sigmoid(r(T, Hv))
    state = 0.3 * r(Hv, Dk, Dv)
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype), state


def _native(shape, case, path=native.BEST, tiled=False, splits=()):
    """The native rule over the case's tokens, in calls split at `splits`: (output [T, Hv, Dv], final state)."""
    q, k, v, g, beta, state = case
    rule = DeltaRulePrompt(*shape, q.dtype, tiled=tiled, path=path)
    state, bounds = state.clone(), [0, *splits, q.shape[0]]
    outs = [rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state) for a, b in zip(bounds, bounds[1:])]
    return torch.cat(outs), state


def _chunked(shape, case, exact=False, tiled=False):
    """delta_rule.chunked over the case in one call, in float32 (the inputs' dtype) or (exact) float64 from the same
    values; tiled: q and k repeated whole first (value head j reads key head j % nK), as gated_deltanet.py does."""
    q, k, v, g, beta, state = case
    if tiled:
        r = shape[1] // shape[0]
        q, k = q.repeat(1, r, 1), k.repeat(1, r, 1)
    state = state.double() if exact else state.clone()
    if exact:
        q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    return delta_rule.chunked(q, k, v, g, beta, state), state


def _rel(x, ref) -> float:
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


@pytest.mark.parametrize("T", [150, 64, 7])
@pytest.mark.parametrize("shape", SHAPES)
def test_float32_is_chunked_to_float32_rounding(shape, T):
    """float32, from a non-zero state: the output and the state within BOUND of chunked's and of the float64 run, and
    no farther from the float64 run than chunked's own float32 (within rounding noise): 150 tokens are two blocks and
    a tail of 22, 64 one block, 7 a tail alone."""
    case = _case(shape, T, seed=T + sum(shape))
    out, state = _native(shape, case)
    ref, ref_state = _chunked(shape, case)
    exact, exact_state = _chunked(shape, case, exact=True)
    assert out.dtype == torch.float32 and out.shape == (T, shape[1], shape[3])
    assert _rel(out, ref) < BOUND and _rel(state, ref_state) < BOUND
    assert _rel(out, exact) < BOUND and _rel(state, exact_state) < BOUND
    assert _rel(out, exact) < 4 * _rel(ref, exact) + 1e-6
    assert _rel(state, exact_state) < 4 * _rel(ref_state, exact_state) + 1e-6


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_float32_is_transformers_reference_to_float32_rounding(shape):
    """Against transformers' torch_chunk_gated_delta_rule (its own l2 norm, q / k repeated to the value heads),
    150 tokens from a non-zero state, on every kernel this CPU runs."""
    ref_mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next",
                                  reason="transformers' Qwen3-Next is the reference")
    case = _case(shape, 150, seed=1)
    q, k, v, g, beta, state = case
    r = shape[1] // shape[0]
    with torch.no_grad():
        want, want_state = ref_mod.torch_chunk_gated_delta_rule(
            q.repeat_interleave(r, 1)[None], k.repeat_interleave(r, 1)[None], v[None], g[None], beta[None],
            initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    for out, final in on_each(lambda path: _native(shape, case, path)):
        assert _rel(out, want[0]) < BOUND and _rel(final, want_state[0]) < BOUND


def test_calls_carry_the_state():
    """150 tokens in calls of 37, 64 and 49 (blocks split at other places than one call's): the one call's output and
    state to float32 rounding, both within BOUND of the float64 run."""
    shape = SHAPES[1]
    case = _case(shape, 150, seed=3)
    whole, whole_state = _native(shape, case)
    split, split_state = _native(shape, case, splits=(37, 101))
    exact, exact_state = _chunked(shape, case, exact=True)
    assert _rel(split, whole) < BOUND and _rel(split_state, whole_state) < BOUND
    assert _rel(split, exact) < BOUND and _rel(split_state, exact_state) < BOUND


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1]])
def test_tiled_heads_read_key_head_j_mod_nk(shape):
    """tiled (llama.cpp's qwen35 GGUFs): chunked with q and k repeated whole, on every kernel; the grouped rule of the
    same inputs is another layer (far from it)."""
    case = _case(shape, 100, seed=5)
    ref, ref_state = _chunked(shape, case, tiled=True)
    exact, exact_state = _chunked(shape, case, exact=True, tiled=True)
    for out, state in on_each(lambda path: _native(shape, case, path, tiled=True)):
        assert _rel(out, ref) < BOUND and _rel(state, ref_state) < BOUND
        assert _rel(out, exact) < BOUND and _rel(state, exact_state) < BOUND
    grouped, grouped_state = _native(shape, case)
    assert _rel(grouped, ref) > 1e-2 and _rel(grouped_state, ref_state) > 1e-2


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_bf16_rounds_the_output_once_as_chunked(shape, tiled):
    """bf16 q, k, v, beta: the rule in float32 on the bf16 values, its output rounded to bf16 once, as chunked: as
    close to the float64 run of the same bf16 values as chunked's own bf16 output (within 1.5x), the float32 state
    within BOUND, and most values chunked's bits."""
    case = _case(shape, 100, torch.bfloat16, seed=7)
    out, state = _native(shape, case, tiled=tiled)
    ref, ref_state = _chunked(shape, case, tiled=tiled)
    exact, exact_state = _chunked(shape, case, exact=True, tiled=tiled)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    l2 = lambda x: ((x.double() - exact).norm() / exact.norm()).item()  # noqa: E731
    assert l2(out) <= 1.5 * l2(ref)
    assert _rel(state, exact_state) < BOUND and _rel(state, ref_state) < BOUND
    assert (out != ref).float().mean() < 0.05


@pytest.mark.parametrize("T", [1, 2, 3, 5])
def test_a_few_tokens_on_every_path(T):
    """Calls of 1-5 tokens (a prompt's tail, a slice's remainder; one row tile or part of one): chunked's output and
    state to float32 rounding on every kernel, the same bits on each, grouped and tiled."""
    shape, orders = SHAPES[1], (False, True)
    case = _case(shape, T, seed=20 + T)
    refs = [_chunked(shape, case, tiled=tiled) for tiled in orders]
    outs = on_each(lambda path: [list(_native(shape, case, path, tiled)) for tiled in orders])
    for per_path in outs:
        for (out, state), (ref, ref_state) in zip(per_path, refs):
            assert out.shape == (T, shape[1], shape[3])
            assert _rel(out, ref) < BOUND and _rel(state, ref_state) < BOUND
    same_bits(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,tiled", [(s, False) for s in SHAPES] + [(SHAPES[1], True)])
def test_every_path_gives_the_same_bits(shape, tiled, dtype):
    case = _case(shape, 70, dtype, seed=9)
    same_bits(on_each(lambda path: list(_native(shape, case, path, tiled, splits=(5,)))))


@pytest.mark.parametrize("tiled", [False, True])
def test_any_thread_count_gives_the_same_bits(tiled):
    shape = SHAPES[0]
    case = _case(shape, 80, torch.bfloat16, seed=11)
    outs = []
    try:
        for threads in (1, 2, 3):
            native.set_threads(threads)
            outs.append(_native(shape, case, tiled=tiled))
    finally:
        native.set_threads(1)
    assert all(torch.equal(a, b) for o in outs[1:] for a, b in zip(outs[0], o))


def test_the_kernel_is_the_decode_steps_choice():
    """Chosen once when made, by the CPU and the path cap, as the decode step's (the same CPU features)."""
    for path in (native.BEST, native.AVX2, native.PORTABLE):
        isa = DeltaRulePrompt(2, 4, 16, 24, torch.float32, path=path).isa
        assert isa == DeltaNetDecode(2, 4, 16, 24, 4, torch.float32, path=path).isa and isa in KERNELS
    assert DeltaRulePrompt(2, 4, 16, 24, torch.float32, path=native.PORTABLE).isa == "portable"


def test_bad_arguments_are_named():
    shape = SHAPES[1]
    q, k, v, g, beta, state = _case(shape, 10)
    with pytest.raises(ValueError, match="multiple of n_k_heads"):
        DeltaRulePrompt(3, 8, 16, 60, torch.float32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        DeltaRulePrompt(*shape, torch.float16)
    rule = DeltaRulePrompt(*shape, torch.float32)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, state=state)
    for name, bad in (("q", q[:, :1]), ("k", k.bfloat16()), ("v", v[:5]), ("g", g.double()), ("beta", beta[:, :2]),
                      ("state", state[:, :8]), ("state", state.transpose(1, 2))):
        with pytest.raises(ValueError, match=f"DeltaRulePrompt: {name} must be"):
            rule(**{**args, name: bad})
    # a view whose heads are not row by row (the conv's transposed output) is read through a copy, not refused
    qt = q.reshape(10, -1).T.contiguous().T.reshape(q.shape)
    assert qt.stride(0) == 1
    out = rule(**{**args, "q": qt, "state": state.clone()})
    assert torch.equal(out, rule(**{**args, "state": state.clone()}))


# -- in a model --------------------------------------------------------------------------------------------------------
IDS = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(4)).tolist()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from tests.models.tiny import hf_model, write_checkpoint

    cache: dict = {}

    def get(arch: str, dtype: torch.dtype):
        if (arch, dtype) not in cache:
            cache[arch, dtype] = write_checkpoint(hf_model(arch, dtype), tmp_path_factory.mktemp(arch), "per_expert")
        return cache[arch, dtype]

    return get


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_a_models_prompt_logits_with_the_native_rule_are_the_torch_rules(folders, arch):
    """A 150-token prompt (two blocks and a tail, a slice), native rule against delta_rule.chunked
    (Kernels(native_delta_prompt=False)): float32 to float32 rounding; bf16 as close to the float32 model as the
    torch rule in bf16 (1.5x)."""
    got = {}
    for dtype in (torch.float32, torch.bfloat16):
        with sluice.load(folders(arch, dtype)) as m:
            fast = m.model
            assert fast.build.delta_prompt is not None and fast.build.delta_prompt.dtype is dtype
            slow = fast.rebuilt(Kernels(native_delta_prompt=False))
            assert slow.build.delta_prompt is None
            with torch.inference_mode():
                got[dtype] = [tm.logits(tm.forward(torch.tensor(IDS), 0)).float() for tm in (fast, slow)]
    (fast32, slow32), (fast16, slow16) = got[torch.float32], got[torch.bfloat16]
    assert _rel(fast32, slow32) < 1e-5
    err = lambda x: (x - slow32).abs().amax(-1).max().item()  # noqa: E731
    assert err(fast16) <= 1.5 * err(slow16)
