"""The causal depthwise conv (with silu) before a prompt's delta rule in one native call (DeltaRulePrompt.conv,
delta_prompt.c sluice_conv_prompt) against the torch steps it replaces (models/layers/gated_deltanet.py `_conv`'s
concatenation, conv1d and silu): float32 to float32 rounding, bf16 within one rounding of the output, the carried
state bitwise; the same bits on every kernel and thread count, and over calls that split the tokens anywhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.quant import native
from sluice.quant.native.delta_prompt import DeltaRulePrompt
from tests.quant.paths import on_each, same_bits

pytestmark = pytest.mark.skipif(not native.native_available(),
                                reason="native kernels not built (pip install -e . with a C compiler builds them)")


def _case(T: int, C: int, K: int, dtype: torch.dtype, seed: int = 0):
    """qkv [T, C] as the projections give it, w [C, 1, K] and a non-zero state [C, K - 1], in dtype."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return (2 * r(T, C)).to(dtype), (0.5 * r(C, 1, K)).to(dtype), r(C, K - 1).to(dtype)


def _torch(qkv, w, state):
    """gated_deltanet.py's torch steps: ([T, C], the new state)."""
    state = state.clone()
    seq = torch.cat([state, qkv.transpose(0, 1)], dim=1)
    state.copy_(seq[:, seq.shape[1] - state.shape[1]:])
    out = F.conv1d(seq[None].to(w.dtype), w, groups=w.shape[0])[0]
    return F.silu(out).to(qkv.dtype).transpose(0, 1), state


def _native(qkv, w, state, path=native.BEST, splits=()):
    rule = DeltaRulePrompt(1, 1, 8, 8, qkv.dtype, path=path)
    state, bounds = state.clone(), [0, *splits, qkv.shape[0]]
    return torch.cat([rule.conv(qkv[a:b], w, state) for a, b in zip(bounds, bounds[1:])]), state


@pytest.mark.parametrize("T", [1, 2, 3, 5, 64, 300])
@pytest.mark.parametrize("C", [40, 600])  # a tail of channels past 8-wide vectors; several 256-channel blocks
def test_float32_is_the_torch_steps_to_float32_rounding(T, C):
    case = _case(T, C, 4, torch.float32, seed=T + C)
    (got, got_state), (ref, ref_state) = _native(*case), _torch(*case)
    assert torch.equal(got_state, ref_state)  # the last 3 inputs, moved as they are
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("T", [1, 3, 64, 300])
def test_bf16_is_the_torch_steps_within_one_rounding(T):
    """Both round the conv's sum to bf16 and silu's result to bf16; their float32 sums may differ in the last bit
    (other orders), which can move a value across a rounding boundary: never by more than one bf16 step."""
    case = _case(T, 600, 4, torch.bfloat16, seed=T)
    (got, got_state), (ref, ref_state) = _native(*case), _torch(*case)
    assert torch.equal(got_state, ref_state)
    step = ref.float().abs().clamp_min(1e-3) * 2.0 ** -7  # one bf16 step at each value
    assert bool(((got.float() - ref.float()).abs() <= step * 1.01).all())
    assert (got != ref).float().mean().item() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_calls_carry_the_state_and_every_path_gives_the_same_bits(dtype):
    qkv, w, state = _case(70, 300, 4, dtype, seed=3)
    whole = _native(qkv, w, state)
    for splits in ((1,), (2, 3), (1, 2, 3, 40)):  # calls shorter than the state (K - 1 = 3 tokens) and longer
        assert all(torch.equal(a, b) for a, b in zip(whole, _native(qkv, w, state, splits=splits)))
    same_bits(on_each(lambda path: list(_native(qkv, w, state, path, splits=(5,)))))


def test_any_thread_count_and_strided_rows_give_the_same_bits():
    qkv, w, state = _case(50, 1100, 4, torch.bfloat16, seed=5)
    wide = torch.cat([qkv, qkv[:, :7]], dim=1)[:, :1100]  # rows 1107 apart: a slice of a wider projection output
    outs = []
    try:
        for threads in (1, 2, 3):
            native.set_threads(threads)
            outs.append(_native(qkv, w, state))
        outs.append(_native(wide, w, state))
    finally:
        native.set_threads(1)
    assert all(torch.equal(a, b) for o in outs[1:] for a, b in zip(outs[0], o))


def test_other_tap_counts_and_bad_arguments():
    for K in (1, 2, 8):
        case = _case(9, 40, K, torch.float32, seed=K)
        (got, got_state), (ref, ref_state) = _native(*case), _torch(*case)
        assert torch.equal(got_state, ref_state) and (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    rule = DeltaRulePrompt(1, 1, 8, 8, torch.float32)
    qkv, w, state = _case(4, 40, 9, torch.float32)
    with pytest.raises(ValueError, match="1 to 8"):
        rule.conv(qkv, w, state)
    qkv, w, state = _case(4, 40, 4, torch.float32)
    for name, args in (("qkv", (qkv[:, :30], w, state)), ("conv weight", (qkv, w.bfloat16(), state)),
                       ("conv state", (qkv, w, state[:, :2]))):
        with pytest.raises(ValueError, match=f"DeltaRulePrompt: {name} must be"):
            rule.conv(*args)


def _mixers(model):
    """The model's GatedDeltaNet mixers (searched through its layers' attributes)."""
    from sluice.models.layers.gated_deltanet import GatedDeltaNet

    found, todo, seen = [], list(model.layers), set()
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, (torch.Tensor, str, int, float, type(None))):
            continue
        seen.add(id(o))
        if isinstance(o, GatedDeltaNet):
            found.append(o)
        elif hasattr(o, "__dict__"):
            todo += list(vars(o).values())
    return found


@pytest.mark.parametrize("taps", [4, 9])
def test_a_model_runs_the_native_conv_up_to_its_tap_limit(tmp_path, taps):
    """A checkpoint whose conv has more taps than the native conv takes keeps the torch steps (a clean run, not the
    kernel's refusal mid-prompt); either way its float32 prompt logits are the torch conv's to float32 rounding."""
    import sluice
    from sluice.models.layers.build import Kernels
    from sluice.quant.native.delta_prompt import CONV_MAX_TAPS
    from tests.models.tiny import hf_model, write_checkpoint

    folder = write_checkpoint(hf_model("qwen3_next", linear_conv_kernel_dim=taps), tmp_path, "per_expert")
    ids = torch.tensor(list(range(3, 83)))
    with sluice.load(folder) as m:
        fast = m.model
        mixers = _mixers(fast)
        assert mixers and all(mx.native_conv is (taps <= CONV_MAX_TAPS) for mx in mixers)
        slow = fast.rebuilt(Kernels(native_delta_prompt=False))
        assert not any(mx.native_conv for mx in _mixers(slow))
        with torch.inference_mode():
            a, b = (tm.logits(tm.forward(ids, 0)).float() for tm in (fast, slow))
    assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()
