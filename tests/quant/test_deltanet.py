"""One decode token of a Gated DeltaNet layer in one native call (native/deltanet.py, deltanet.c) against the torch
steps it replaces (models/layers/gated_deltanet.py: the conv, delta_rule.recurrent, norm.gated_rms_norm) and against
transformers' own pieces (Qwen3-Next's causal_conv1d_update, torch_recurrent_gated_delta_rule, RMSNormGated), on each
kernel (portable, AVX2, AVX-512: tests/quant/paths.py runs every one this CPU has, so an AVX-512 CPU tests the AVX2
kernel too); and in a model: the kernel chosen once at load by the isa cap, decode logits near the torch steps',
greedy tokens equal to transformers' on each kernel, streamed == resident bitwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sluice
from sluice.models.layers import delta_rule
from sluice.models.layers.build import Kernels
from sluice.models.layers.norm import gated_rms_norm
from sluice.quant import native
from sluice.quant.native.deltanet import KERNELS, DeltaNetDecode
from tests.models.tiny import TINY, hf_model, write_checkpoint
from tests.quant.paths import on_each, same_bits
from tests.quant.streaming import assert_streamed_equals_resident

pytestmark = pytest.mark.skipif(not native.native_available(),
                                reason="native kernels not built (pip install -e . with a C compiler builds them)")

EPS = 1e-6
# nK, Hv, Dk, Dv, K: Qwen3.6-35B-A3B's linear attention (the pool's heads), key heads repeated with a column tail
# (24: three 8-column blocks), one value head per key head with a scalar tail (36) and a 3-tap conv
SHAPES = [(16, 32, 128, 128, 4), (2, 4, 16, 24, 4), (4, 4, 32, 36, 3)]
# several value heads per key head, where tiled and grouped differ: Qwen3.6-35B-A3B's, and four per key head with a
# 32-, an 8-column block and no tail (40)
TILED_SHAPES = [SHAPES[0], (2, 8, 16, 40, 4)]


def _case(nK, Hv, Dk, Dv, K, dtype, seed, steps):
    """Weights, a nonzero starting state and `steps` tokens' projections of one layer (float32 masters)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale  # noqa: E731
    C = 2 * nK * Dk + Hv * Dv
    w = dict(conv=r(C, 1, K, scale=0.5), norm=1 + r(Dv, scale=0.1),
             neg_A=-torch.empty(Hv).uniform_(1, 16, generator=g), dt_bias=r(Hv, scale=0.5) - 1)
    conv_state, state = r(C, K - 1), r(Hv, Dk, Dv, scale=0.05)
    tokens = [dict(qkv=r(1, C), z=r(1, Hv * Dv), b=r(1, Hv, scale=2), a=r(1, Hv, scale=2)) for _ in range(steps)]
    tokens[0]["a"][0, 0] = 25.0  # softplus past its threshold of 20: the input itself
    cast = lambda t: t.to(dtype)  # noqa: E731
    w = {n: t if n in ("neg_A", "dt_bias") else cast(t) for n, t in w.items()}
    return w, cast(conv_state), state, [{n: cast(t) for n, t in tok.items()} for tok in tokens]


def _torch_step(nK, Hv, Dk, Dv, w, conv_state, state, tok, tiled=False):
    """gated_deltanet.py's torch steps of one token (T == 1) in the inputs' dtype; the states updated in place.
    tiled: value head j reads key head j % nK, so q and k are repeated whole before the rule (which repeats each key
    head in place: grouped)."""
    qkv = tok["qkv"]
    seq = torch.cat([conv_state, qkv.transpose(0, 1)], dim=1)  # [C, K]
    conv_state.copy_(seq[:, 1:])
    y = F.silu(F.conv1d(seq[None].to(w["conv"].dtype), w["conv"], groups=seq.shape[0])[0]).to(qkv.dtype).T
    q, k, v = y.split([nK * Dk, nK * Dk, Hv * Dv], dim=-1)
    beta = tok["b"].sigmoid()
    g = w["neg_A"].to(state.dtype) * F.softplus(tok["a"].to(state.dtype) + w["dt_bias"].to(state.dtype))
    q, k = q.reshape(1, nK, Dk), k.reshape(1, nK, Dk)
    if tiled:
        q, k = q.repeat(1, Hv // nK, 1), k.repeat(1, Hv // nK, 1)
    o = delta_rule.recurrent(q, k, v.reshape(1, Hv, Dv), g, beta, state)
    return gated_rms_norm(o, tok["z"].view(1, Hv, Dv), w["norm"], EPS).reshape(1, Hv * Dv)


def _run(shape, w, conv_state, state, tokens, dtype, path=native.BEST, tiled=False):
    """The native step over `tokens`: (outputs [steps, Hv Dv], conv state, state); the given states are kept."""
    nK, Hv, Dk, Dv, K = shape
    conv_state, state = conv_state.clone(), state.clone()
    layer = DeltaNetDecode(nK, Hv, Dk, Dv, K, dtype, tiled=tiled, path=path).layer(
        w["conv"], conv_state, state, w["neg_A"], w["dt_bias"], w["norm"], EPS)
    outs = [layer(t["qkv"], t["z"], t["b"], t["a"]) for t in tokens]
    return torch.cat(outs), conv_state, state


def _reference(shape, w, conv_state, state, tokens, exact: bool = False, tiled: bool = False):
    """The torch steps over `tokens` in the inputs' dtype, or (exact) in float64 from the same values."""
    nK, Hv, Dk, Dv, _ = shape
    to = (lambda t: t.double()) if exact else (lambda t: t.clone())  # noqa: E731
    w, conv_state, state = {n: to(t) for n, t in w.items()}, to(conv_state), to(state)
    outs = [_torch_step(nK, Hv, Dk, Dv, w, conv_state, state, {n: to(t) for n, t in tok.items()}, tiled)
            for tok in tokens]
    return torch.cat(outs), conv_state, state


def _rel(x, ref):
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


@pytest.mark.parametrize("shape", SHAPES)
def test_float32_is_the_torch_steps_to_float32_rounding(shape):
    """float32: the native step and the torch steps compute the same float32 operations in other orders (bmm's and
    conv1d's sums, exp_poly's silu within 2 ulp against torch's 1), so after 6 tokens on a carried state both stay
    within a few 1e-7 of the exact (float64) steps of the same inputs relative to the largest value; the bound 1e-5
    leaves room for an unlucky seed, not for a wrong order of operations (a missing rounding, the decay applied after
    the read, q unscaled: each >= 1e-3 here)."""
    w, cs, st, tokens = _case(*shape, torch.float32, seed=sum(shape), steps=6)
    out, cs1, st1 = _run(shape, w, cs, st, tokens, torch.float32)
    ref, ref_cs, ref_st = _reference(shape, w, cs, st, tokens)
    exact, _, exact_st = _reference(shape, w, cs, st, tokens, exact=True)
    assert out.dtype == torch.float32 and out.shape == (6, shape[1] * shape[3])
    assert torch.equal(cs1, ref_cs)  # the conv state moves the inputs' bits
    assert _rel(out, exact) < 1e-5 and _rel(st1, exact_st) < 1e-5
    assert _rel(out, ref) < 1e-5 and _rel(st1, ref_st) < 1e-5
    # no worse than torch's own float32 steps, within rounding noise
    assert _rel(out, exact) < 4 * _rel(ref, exact) + 1e-6


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_bf16_rounds_where_the_torch_steps_round(shape):
    """bf16: the conv's output, its silu, beta, the rule's output and the norm's steps are rounded to bf16 where the
    torch steps round them; a value near a rounding boundary may land one bf16 step away, so against the exact
    steps (float64 from the same bf16 inputs) the native output is as close as torch's own bf16 steps (within 1.5x),
    and the float32 state as close as theirs."""
    w, cs, st, tokens = _case(*shape, torch.bfloat16, seed=3, steps=6)
    out, _, st1 = _run(shape, w, cs, st, tokens, torch.bfloat16)
    ref, _, ref_st = _reference(shape, w, cs, st, tokens)
    exact, _, exact_st = _reference(shape, w, cs, st, tokens, exact=True)
    assert out.dtype == torch.bfloat16
    l2 = lambda x: ((x.double() - exact).norm() / exact.norm()).item()  # noqa: E731
    assert l2(out) <= 1.5 * l2(ref)
    assert _rel(st1, exact_st) <= 1.5 * _rel(ref_st, exact_st) + 1e-6
    assert (out != ref).float().mean() < 0.05  # most values are torch's bits


@pytest.mark.parametrize("shape", TILED_SHAPES)
def test_tiled_heads_are_the_torch_steps_with_q_and_k_repeated_whole(shape):
    """tiled (llama.cpp's qwen35 GGUFs): value head j reads key head j % nK, the torch steps with q and k repeated
    as a whole; float32 within 1e-5 of them and of the exact steps (as the grouped order above), on every kernel this
    CPU runs; the grouped step of the same inputs is another layer (far from them)."""
    w, cs, st, tokens = _case(*shape, torch.float32, seed=13 + sum(shape), steps=6)
    ref, ref_cs, ref_st = _reference(shape, w, cs, st, tokens, tiled=True)
    exact, _, exact_st = _reference(shape, w, cs, st, tokens, exact=True, tiled=True)
    for out, cs1, st1 in on_each(lambda path: _run(shape, w, cs, st, tokens, torch.float32, path, tiled=True)):
        assert torch.equal(cs1, ref_cs)
        assert _rel(out, exact) < 1e-5 and _rel(st1, exact_st) < 1e-5
        assert _rel(out, ref) < 1e-5 and _rel(st1, ref_st) < 1e-5
    grouped, _, grouped_st = _run(shape, w, cs, st, tokens, torch.float32)
    assert _rel(grouped, ref) > 1e-2 and _rel(grouped_st, ref_st) > 1e-2


@pytest.mark.parametrize("shape", TILED_SHAPES)
def test_tiled_bf16_rounds_where_the_torch_steps_round(shape):
    """bf16, tiled: as close to the exact steps as torch's own tiled bf16 steps (the grouped order's bound)."""
    w, cs, st, tokens = _case(*shape, torch.bfloat16, seed=17, steps=6)
    out, _, st1 = _run(shape, w, cs, st, tokens, torch.bfloat16, tiled=True)
    ref, _, ref_st = _reference(shape, w, cs, st, tokens, tiled=True)
    exact, _, exact_st = _reference(shape, w, cs, st, tokens, exact=True, tiled=True)
    l2 = lambda x: ((x.double() - exact).norm() / exact.norm()).item()  # noqa: E731
    assert l2(out) <= 1.5 * l2(ref)
    assert _rel(st1, exact_st) <= 1.5 * _rel(ref_st, exact_st) + 1e-6
    assert (out != ref).float().mean() < 0.05


def _transformers_steps(shape, w, conv_state, state, tokens):
    """The same tokens through transformers' Qwen3-Next pieces, float32: causal_conv1d_update (silu), the gated delta
    rule token by token with its own l2 norm of q and k, Qwen3NextRMSNormGated; beta and g as its layer makes them.
    -> (outputs [steps, Hv Dv], conv state, state); the given states are kept."""
    ref = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next",
                              reason="transformers' Qwen3-Next is the reference")
    nK, Hv, Dk, Dv, _ = shape
    conv_state, state = conv_state[None].clone(), state[None].clone()  # [1, C, K - 1], [1, Hv, Dk, Dv]
    norm = ref.Qwen3NextRMSNormGated(Dv, eps=EPS)
    outs = []
    with torch.no_grad():
        norm.weight.copy_(w["norm"])
        for t in tokens:
            y = ref.causal_conv1d_update(t["qkv"][:, :, None], conv_state, w["conv"].squeeze(1), None, "silu")
            q, k, v = y.transpose(1, 2).split([nK * Dk, nK * Dk, Hv * Dv], dim=-1)  # [1, 1, n] each
            g = w["neg_A"] * F.softplus(t["a"].float() + w["dt_bias"])
            q, k, v = q.reshape(1, 1, nK, Dk), k.reshape(1, 1, nK, Dk), v.reshape(1, 1, Hv, Dv)
            o, state = ref.torch_recurrent_gated_delta_rule(q, k, v, g[None], t["b"].sigmoid()[None],
                                                            initial_state=state, output_final_state=True,
                                                            use_qk_l2norm_in_kernel=True)
            outs.append(norm(o.reshape(Hv, Dv), t["z"].reshape(Hv, Dv)).reshape(1, Hv * Dv))
    return torch.cat(outs), conv_state[0], state[0]


@pytest.mark.parametrize("shape", SHAPES)
def test_float32_is_transformers_reference_to_float32_rounding(shape):
    """Against transformers' own functions (not sluice's torch steps): after 6 tokens on a carried state, the
    outputs, the conv state (bitwise: it holds the inputs) and the recurrent state agree to float32 rounding, on
    every kernel this CPU runs."""
    w, cs, st, tokens = _case(*shape, torch.float32, seed=11 + sum(shape), steps=6)
    ref, ref_cs, ref_st = _transformers_steps(shape, w, cs, st, tokens)
    exact, _, exact_st = _reference(shape, w, cs, st, tokens, exact=True)
    assert _rel(ref, exact) < 1e-5  # the reference itself: float32 rounding of the exact steps
    for out, cs1, st1 in on_each(lambda path: _run(shape, w, cs, st, tokens, torch.float32, path)):
        assert torch.equal(cs1, ref_cs)
        assert _rel(out, ref) < 1e-5 and _rel(st1, ref_st) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,tiled", [(s, False) for s in SHAPES] + [(s, True) for s in TILED_SHAPES])
def test_every_path_gives_the_same_bits(shape, tiled, dtype):
    w, cs, st, tokens = _case(*shape, dtype, seed=5, steps=3)
    same_bits(on_each(lambda path: list(_run(shape, w, cs, st, tokens, dtype, path, tiled))))


@pytest.mark.parametrize("tiled", [False, True])
def test_any_thread_count_gives_the_same_bits(tiled):
    shape = SHAPES[0]
    nK, Hv, Dk, Dv, K = shape
    assert Hv * Dk * Dv >= 65536  # past deltanet.c's threshold for the pool
    w, cs, st, tokens = _case(*shape, torch.bfloat16, seed=7, steps=3)
    outs = []
    try:
        for threads in (1, 2, 3):
            native.set_threads(threads)
            outs.append(list(_run(shape, w, cs, st, tokens, torch.bfloat16, tiled=tiled)))
    finally:
        native.set_threads(1)
    assert all(torch.equal(a, b) for o in outs[1:] for a, b in zip(outs[0], o))


def _cpu_flags() -> set[str]:
    """This CPU's flags as the kernel reports them (/proc/cpuinfo), independent of the library's own checks."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def test_the_kernel_is_chosen_once_by_the_cpu_and_the_path_cap():
    """DeltaNetDecode picks its kernel when it is made (Build: once per model, by the model's isa cap), the best the
    CPU runs under the cap: portable under "portable", AVX2 under "avx2", AVX-512 where the CPU has AVX512F."""
    flags = _cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to check the choice against")
    isa = lambda path: DeltaNetDecode(2, 4, 16, 24, 4, torch.float32, path=path).isa  # noqa: E731
    avx2 = native.simd()
    assert avx2 == ({"avx2", "fma", "f16c"} <= flags)
    assert isa(native.PORTABLE) == "portable"
    assert isa(native.AVX2) == ("avx2" if avx2 else "portable")
    assert isa(native.BEST) == ("avx512" if avx2 and "avx512f" in flags else isa(native.AVX2))
    assert set(KERNELS) == {"portable", "avx2", "avx512"}


def test_bad_arguments_are_named():
    shape = (2, 4, 16, 24, 4)
    w, cs, st, tokens = _case(*shape, torch.float32, seed=0, steps=1)
    with pytest.raises(ValueError, match="multiple of n_k_heads"):
        DeltaNetDecode(3, 4, 16, 24, 4, torch.float32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        DeltaNetDecode(*shape, torch.float16)
    step = DeltaNetDecode(*shape, torch.float32)
    args = dict(conv=w["conv"], conv_state=cs, state=st, neg_A=w["neg_A"], dt_bias=w["dt_bias"], norm=w["norm"])
    for name, bad in (("state", st.double()), ("conv_state", cs[:, :2].contiguous()), ("conv", w["conv"][:-1]),
                      ("norm", w["norm"].bfloat16()), ("neg_A", w["neg_A"][:2])):
        with pytest.raises(ValueError, match=f"DeltaNetDecode: {name} must be"):
            step.layer(**{**args, name: bad}, eps=EPS)
    layer = step.layer(**args, eps=EPS)
    t = tokens[0]
    for name, bad in (("qkv", t["qkv"][:, :-1]), ("z", t["z"].bfloat16()), ("b", t["b"].T.contiguous()),
                      ("a", torch.randn(1, 8)[:, ::2])):
        with pytest.raises(ValueError, match=f"DeltaNetDecode: {name} must be"):
            layer(**{**t, name: bad})


# -- in a model --------------------------------------------------------------------------------------------------------
IDS = torch.randint(0, 300, (80,), generator=torch.Generator().manual_seed(2)).tolist()


# value heads of 60 columns: a 32-column block, a 16- and an 8-column one and a 4-column tail, so a model runs every
# block of every kernel (the tiny configs' 8 and 12 reach only AVX2's 8 columns and the tail)
WIDE_DV = 60


def _wide(arch: str) -> dict:
    """hf_model overrides giving `arch`'s tiny config value heads of WIDE_DV."""
    if "text_config" in TINY[arch]:
        return {"text_config": {**TINY[arch]["text_config"], "linear_value_head_dim": WIDE_DV}}
    return {"linear_value_head_dim": WIDE_DV}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(arch, dtype, wide) -> (folder, transformers model), written once per module."""
    cache: dict = {}

    def get(arch: str, dtype: torch.dtype, wide: bool = False):
        if (arch, dtype, wide) not in cache:
            model = hf_model(arch, dtype, **(_wide(arch) if wide else {}))
            cache[arch, dtype, wide] = (write_checkpoint(model, tmp_path_factory.mktemp(arch), "per_expert"), model)
        return cache[arch, dtype, wide]

    return get


@pytest.fixture(scope="module")
def folders(models):
    return lambda arch, dtype: models(arch, dtype)[0]


def _decode_logits(tm, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits of each teacher-forced decode step after the prompt (the state carried from the prompt on)."""
    with torch.inference_mode():
        tm.forward(torch.tensor(prompt), 0)
        return torch.cat([tm.logits(tm.forward(torch.tensor([t]), p)).float()
                          for p, t in enumerate(tokens, len(prompt))])


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_a_models_decode_logits_with_the_native_step_are_the_torch_steps(folders, arch):
    """40 decode steps after a 40-token prompt, native against torch (Kernels(native_deltanet=False)): float32 within
    float32 rounding of each other; bf16 as close to the float32 model as the torch steps in bf16 are (1.5x)."""
    prompt, tokens = IDS[:40], IDS[40:]
    got = {}
    for dtype in (torch.float32, torch.bfloat16):
        with sluice.load(folders(arch, dtype)) as m:
            native_tm = m.model
            assert native_tm.build.native_deltanet and m.dtype == dtype
            torch_tm = native_tm.rebuilt(Kernels(native_deltanet=False))
            assert not torch_tm.build.native_deltanet
            got[dtype] = (_decode_logits(native_tm, prompt, tokens), _decode_logits(torch_tm, prompt, tokens))
    (fast32, slow32), (fast16, slow16) = got[torch.float32], got[torch.bfloat16]
    assert _rel(fast32, slow32) < 1e-5
    err = lambda x: (x - slow32).abs().amax(-1).max().item()  # noqa: E731
    assert err(fast16) <= 1.5 * err(slow16)


@pytest.mark.parametrize("isa", ["auto", "avx2"])
@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_greedy_tokens_equal_transformers_on_each_kernel(models, arch, isa):
    """float32, value heads of WIDE_DV columns, a 70-token prompt (past the 64-token block) then 12 greedy tokens, 11
    of them decode steps on the native step: transformers' tokens, with the kernel the isa cap allows (auto: AVX-512
    where the CPU has it; the same run capped to AVX2, what an AVX2-only CPU runs)."""
    folder, model = models(arch, torch.float32, wide=True)
    ids = IDS[:70]
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    with sluice.load(folder, isa=isa) as m:
        step, cap = m.model.build.deltanet_decode, {"auto": native.BEST, "avx2": native.AVX2}[isa]
        assert step is not None and step.isa == DeltaNetDecode(1, 1, 1, 1, 1, torch.float32, path=cap).isa
        assert m.spec.delta.v_head_dim == WIDE_DV
        out = list(m.generate_tokens(ids, max_tokens=12, stop_at_eos=False))
    assert out == ref[0, len(ids):].tolist()


def test_streamed_equals_resident_bitwise_with_the_native_step(models):
    folder = models("qwen3_5_moe", torch.bfloat16, wide=True)[0]  # every block of the kernel this CPU runs
    with sluice.load(folder) as m:
        assert m.model.build.native_deltanet
    assert_streamed_equals_resident(folder, IDS[:40], "direct", False, "min")
