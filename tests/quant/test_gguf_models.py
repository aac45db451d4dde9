"""Quantized GGUF models run as downloaded: experts stay in their stored blocks from disk to slot to kernel, and
the rest is dequantized once at load.

The reference for a quantized file is its own weights: the same transformers model with every tensor replaced by
the file's exact dequantization (sluice/quant/ggml.py, bitwise `gguf.quants.dequantize`, tests/quant/test_dequant).
dtype=float32 must match it closely (issue 14: relative L2 <= 1e-3), the default dtype (bf16) within 3e-2, and a
streamed run must give bitwise the resident run's logits for every type, reader and cache size (the same kernel on
the same bytes).
"""

from __future__ import annotations

import pytest
import torch

import sluice
from sluice.models.layers import Kernels
from sluice.quant.native import pool
from sluice.quant.native.moe_decode import DecodeExperts
from sluice.quant.tensor import read_tensor
from tests.checkpoint.gguf_files import GGUF_TINY, Q, convert
from tests.models.tiny import hf_model, write_checkpoint
from tests.quant.streaming import assert_streamed_equals_resident
from sluice.plan import open_index

IDS = torch.randint(0, 300, (16,), generator=torch.Generator().manual_seed(11)).tolist()
# experts of more than native.kernel.BF16_GEMM_MIN_ROWS rows each
LONG = torch.randint(0, 300, (192,), generator=torch.Generator().manual_seed(12)).tolist()
# K-quant rows are whole blocks of 256 values: hidden and expert sizes of 256
K_SHAPES = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256, head_dim=64)


def _plain(name: str) -> bool:
    return name.endswith(("norm.weight", "ffn_gate_inp.weight", ".bias"))


def q4_k_m(name: str):
    """llama.cpp's Q4_K_M mix: Q4_K, with the down projections of some layers and the output in Q6_K."""
    if _plain(name):
        return Q.F32
    if name == "output.weight" or name.startswith("blk.0.ffn_down") or name.endswith("attn_v.weight"):
        return Q.Q6_K
    return Q.Q4_K


TYPES = {  # name -> (type of each 2-D tensor by GGUF name, tiny-config overrides)
    "Q8_0": (lambda n: Q.F32 if _plain(n) else Q.Q8_0, {}),
    "Q4_0": (lambda n: Q.F32 if _plain(n) else Q.Q4_0, {}),
    "Q4_1-Q5_0-Q5_1": (lambda n: Q.F32 if _plain(n) else Q.Q5_1 if "down" in n else Q.Q5_0 if "exps" in n
                       else Q.Q4_1, {}),
    "BF16": (lambda n: Q.F32 if _plain(n) else Q.BF16, {}),
    "Q4_K_M": (q4_k_m, K_SHAPES),
    "Q5_K": (lambda n: Q.F32 if _plain(n) else Q.Q5_K, K_SHAPES),
}


def dequantized_reference(model, gguf_path, read=read_tensor):
    """`model` (transformers) with every tensor replaced by the GGUF file's exact float32 dequantization (`read`:
    TensorRef -> its float32 values in HF row order)."""
    index = open_index(gguf_path)
    sd = {name: read(ref) for name, ref in index.tensors.items()}  # HF names, HF row order
    for n in range(model.config.num_hidden_layers):
        p = f"model.layers.{n}.mlp.experts"
        if f"{p}.gate_proj" in sd:  # stacked [E, I, H] each -> transformers' fused [E, 2I, H]
            sd[f"{p}.gate_up_proj"] = torch.cat([sd.pop(f"{p}.gate_proj"), sd.pop(f"{p}.up_proj")], dim=1)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    return model.eval()


@pytest.fixture(scope="module", params=list(TYPES))
def quantized(request, tmp_path_factory):
    """(type name, GGUF path, transformers model of its dequantized weights, their HF folder)."""
    qtype, overrides = TYPES[request.param]
    model = hf_model("qwen3_moe", **{**GGUF_TINY["qwen3_moe"], **overrides})
    root = tmp_path_factory.mktemp(request.param)
    path = convert(model, root / "m.gguf", qtype=qtype)
    ref = dequantized_reference(model, path)
    return request.param, path, ref, write_checkpoint(ref, root / "hf", "per_expert")


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_float32_is_the_files_own_weights(quantized):
    name, path, ref, folder = quantized
    with torch.no_grad():
        want = ref(torch.tensor([IDS])).logits[0]
    with sluice.load(path, memory="all", dtype="float32") as m:
        got = m.logits(IDS)
        if name != "BF16":
            assert m.layout.plain_dtype is None  # experts stayed quantized in memory
    assert _rel_l2(got, want) <= 1e-3, name
    with sluice.load(folder, memory="all", dtype="float32") as m:  # the same weights from a plain HF folder
        assert _rel_l2(got, m.logits(IDS)) <= 1e-5


def test_default_dtype_is_within_3e_2(quantized):
    name, path, ref, _ = quantized
    with torch.no_grad():
        want = ref(torch.tensor([IDS])).logits[0]
    with sluice.load(path, memory="all") as m:
        assert m.dtype == torch.bfloat16
        err = _rel_l2(m.logits(IDS), want)
    _within_3e_2(name, err, ref, IDS, want)


def _within_3e_2(name: str, err: float, ref, ids: list[int], want: torch.Tensor) -> None:
    if err > 3e-2:
        # Some random tiny models amplify bf16 rounding more than real ones (the Q5_K one: transformers' own bf16
        # run of the same weights is 4.4e-2 off its fp32 run); there, sluice must be no worse than transformers.
        import copy

        with torch.no_grad():
            own = _rel_l2(copy.deepcopy(ref).to(torch.bfloat16)(torch.tensor([ids])).logits[0], want)
        assert err <= own, (name, err, own)


@pytest.mark.parametrize("matmul", ["bf16", "float32"])
def test_long_prompts_take_the_many_row_routes_bitwise_streamed(quantized, matmul):
    """A prompt long enough that experts and projections run their many-row route: under --matmul bf16 the
    weights dequantized straight to bf16 and torch's bf16 GEMM, under float32 the float32 dequantization and GEMM
    (auto picks by the CPU). Either way within the default dtype's tolerance, and a streamed run bitwise the
    resident one. Activations int16 (these routes'; a Q4_K file's default, int8, takes prompt.c's tiles where the
    CPU has VNNI, whose bound is test_prompt_int8.py's)."""
    name, path, ref, _ = quantized
    assert_streamed_equals_resident(path, LONG, "direct", True, "min", matmul=matmul, activations="int16")
    with torch.no_grad():
        want = ref(torch.tensor([LONG])).logits[0]
    with sluice.load(path, memory="all", matmul=matmul, activations="int16") as m:
        _within_3e_2(name, _rel_l2(m.logits(LONG), want), ref, LONG, want)


@pytest.mark.parametrize("io,odirect", [("mmap", False), ("willneed", False), ("direct", False), ("direct", True)])
@pytest.mark.parametrize("cache", ["min", "half"])
def test_streamed_equals_resident_bitwise(quantized, io, odirect, cache):
    assert_streamed_equals_resident(quantized[1], IDS, io, odirect, cache)


def test_slots_hold_the_stored_bytes(quantized):
    """A miss reads one expert's stored blocks, nothing more; the budget buys slots of the quantized size."""
    name, path, _, _ = quantized
    index = open_index(path)
    with sluice.load(path, memory="all") as m:
        resident, layout = m.resident_bytes, m.layout
    fmt = layout.format(layout.layers[0])
    E = m.spec.num_experts
    stored = sum(index[f"model.layers.0.mlp.experts.{p}_proj"].nbytes for p in ("gate", "up", "down")) // E
    assert fmt.stored_nbytes == stored
    assert layout.expert_nbytes <= stored + 128  # alignment padding between projections at most
    with sluice.load(path, memory=resident + 4 * layout.expert_nbytes, io="direct") as m:
        m.logits(IDS)
        st = m.stats()
    per_layer = {L: layout.format(L).stored_nbytes for L in layout.layers}
    assert st["bytes_read"] <= st["misses"] * max(per_layer.values())
    assert st["bytes_read"] >= st["misses"] * min(per_layer.values())


@pytest.mark.parametrize("threads", [1, 2])
def test_decode_runs_one_native_call_per_expert(quantized, threads, monkeypatch):
    """At the default dtype a decode step computes each SiLU expert of a K/legacy-quant file in one native call
    (the model once built ExpertMath with a gate function that turned that path off: 97 vs 78 ms/token): on one
    thread ExpertCall() per expert, on two ExpertCall.many for a layer's experts, their rows over the native pool.
    Counted over the decode step alone (a prompt's rows may take the same calls): its top_k experts of every MoE
    layer, each on its one row."""
    from sluice.quant import native

    name, path, _, _ = quantized
    if name == "BF16":
        pytest.skip("BF16: plain experts, computed by torch")
    rows = []  # x's rows, one entry per expert computed by a one-call kernel
    call, many = native.ExpertCall.__call__, native.ExpertCall.many
    monkeypatch.setattr(native.ExpertCall, "__call__", lambda self, slot, x, *a, **k: (
        rows.append(x.shape[0]), call(self, slot, x, *a, **k))[1])
    monkeypatch.setattr(native.ExpertCall, "many", lambda self, raw, slots, x, *a, **k: (
        rows.extend([x.shape[0]] * len(slots)), many(self, raw, slots, x, *a, **k))[1])
    run = DecodeExperts.run  # a decode block's experts (layers/moe_decode.py): x is one row
    monkeypatch.setattr(DecodeExperts, "run", lambda self, raw, slots, rows_, x, *a: (
        rows.extend([x.shape[0]] * len(slots)), run(self, raw, slots, rows_, x, *a))[1])
    with sluice.load(path, memory="all", threads=threads) as m, torch.inference_mode():
        m.model.forward(torch.tensor(IDS[:4]), 0)  # a 4-token prompt
        rows.clear()
        m.model.forward(torch.tensor([IDS[4]]), 4)  # one decode step
        experts = sum(m.spec.moe_layers) * m.spec.top_k
    assert rows == [1] * experts


def _decode_logits(m, ids: list[int]) -> torch.Tensor:
    """Logits of each decode step after a 4-token prefill (the T == 1 path), [len(ids) - 4, V]."""
    with torch.inference_mode():
        m.model.forward(torch.tensor(ids[:4]), 0)
        return torch.cat([m.model.logits(m.model.forward(torch.tensor([t]), p)) for p, t in enumerate(ids[4:], 4)])


@pytest.mark.parametrize("streamed", [False, True])
def test_decode_experts_split_over_threads_are_bitwise(quantized, streamed):
    """Decode runs a layer's native experts in one call, their rows split over the native threads: the same
    logits, bit for bit, as one expert_q8 call per expert on one thread (each row is the same kernel call on the
    same bytes; the sum keeps its order)."""

    name, path, _, _ = quantized
    if name == "BF16":
        pytest.skip("BF16: plain experts, computed by torch (no native expert calls to split)")
    kw = {}
    if streamed:
        with sluice.load(path, memory="all") as m:
            kw = dict(memory=m.resident_bytes + m.spec.top_k * 2 * m.layout.expert_nbytes, io="direct")
    with sluice.load(path, threads=2, **kw) as m:
        assert pool.threads() == 2
        split = _decode_logits(m, IDS)
        m.model = m.model.rebuilt(Kernels(split_experts=False))
        one = _decode_logits(m, IDS)
    assert torch.equal(split, one)


def test_a_forward_pass_changes_no_process_wide_state(quantized, monkeypatch):
    """Every projection a QuantLinear and every expert one native call: a decode step's experts go to the C pool
    together, on the model's threads, and neither a prefill nor a decode step changes torch's or the pool's thread
    count (a forward pass chooses no kernel and sets nothing process-wide: layers/build.py)."""
    from sluice.quant import native

    name, path, _, _ = quantized
    if name == "BF16":
        pytest.skip("BF16: plain weights, no quantized kernels")
    seen = []
    real, run = native.ExpertCall.many, DecodeExperts.run
    monkeypatch.setattr(native.ExpertCall, "many",
                        lambda *a, **k: (seen.append((torch.get_num_threads(), pool.threads())), real(*a, **k))[1])
    monkeypatch.setattr(DecodeExperts, "run",
                        lambda *a, **k: (seen.append((torch.get_num_threads(), pool.threads())), run(*a, **k))[1])
    threads = torch.get_num_threads()
    try:
        with sluice.load(path, memory="all", threads=2) as m:
            assert m.model.build.integer_decode
            with torch.inference_mode():
                m.model.forward(torch.tensor(IDS[:4]), 0)
                assert (torch.get_num_threads(), pool.threads()) == (2, 2)
                seen.clear()
                m.model.forward(torch.tensor([IDS[4]]), 4)
            assert seen and set(seen) == {(2, 2)} and (torch.get_num_threads(), pool.threads()) == (2, 2)
    finally:
        torch.set_num_threads(threads)
        pool.set_threads(1)


def test_native_decode_attention_and_router_match_the_torch_steps(quantized):
    """A quantized bf16 decode step runs its attention and router probabilities natively (native/decode.py): over
    64 decode steps its logits are about as far from the float32 run's as the torch steps' are (both bf16; the
    native attention is the closer of the two layer by layer, tests/quant/test_decode.py, but these random models
    turn a rounding difference into another expert now and then, so a few tokens decide: the Q5_K model's first
    12 steps are 5.1e-2 off this way, 3.1e-2 the torch way, and its 64 steps 0.32 and 0.30; with int8 activations
    the Q4_1-Q5_0-Q5_1 model's 64 steps are 3.8e-2 and 2.3e-2)."""
    name, path, _, _ = quantized
    if name == "BF16":
        pytest.skip("BF16: plain weights (a plain model's decode keeps the torch steps)")
    ids = torch.randint(0, 300, (68,), generator=torch.Generator().manual_seed(5)).tolist()
    with sluice.load(path, memory="all", dtype="float32") as m:
        exact = _decode_logits(m, ids)
    with sluice.load(path, memory="all") as m:
        assert m.model.build.native_decode
        fast = _decode_logits(m, ids)
        m.model = m.model.rebuilt(Kernels(native_decode=False))  # the torch steps
        assert not m.model.build.native_decode
        slow = _decode_logits(m, ids)
    err_fast, err_slow = _rel_l2(fast, exact), _rel_l2(slow, exact)
    # a wrong rope, norm or cache write is O(1) off; two rounding choices differ by a few routing flips at most
    assert err_fast <= 2 * err_slow, (name, err_fast, err_slow)


def test_a_repeated_seeded_request_repeats(quantized):
    """The same prompt and seed twice give the same tokens: the second request reuses the cached prompt and starts
    from the prefill's last hidden state instead of re-running the last token alone, which on the integer decode
    path gave other bits (the first sampled token differed)."""
    name, path, _, _ = quantized
    with sluice.load(path, memory="all") as m:
        runs = [list(m.generate_tokens(IDS, max_tokens=8, temperature=1.5, seed=3, stop_at_eos=False))
                for _ in range(2)]
        assert m.step_times.prefill_tokens == 0  # nothing re-run
        # rewriting the cache forgets the memo: the next request reuses those 5 positions and prefills the rest
        # (in another chunk shape than the first request's prefill, so its tokens may differ in the last bits)
        m.logits(IDS[:5])
        list(m.generate_tokens(IDS, max_tokens=2, temperature=1.5, seed=3, stop_at_eos=False))
        assert m.step_times.prefill_tokens == len(IDS) - 5
    assert runs[0] == runs[1], name


def test_int8_activations_reach_every_integer_kernel_and_stream_bitwise(quantized):
    """--activations int8 (llama.cpp's one-plane coding) is what every projection and expert of the integer path
    computes with: the decode logits change, stay near the float32 run's, and a streamed run still gives the
    resident run's bits."""
    from sluice.models.model import Transformer
    from sluice.quant.linear import QuantLinear

    name, path, _, _ = quantized
    if name == "BF16":
        pytest.skip("BF16: plain weights, no integer kernels")
    with sluice.load(path, memory="all", dtype="float32") as m:
        exact = _decode_logits(m, IDS)
    logits = {}
    for act in ("int16", "int8"):
        with sluice.load(path, memory="all", activations=act) as m:
            t: Transformer = m.model
            planes = {w.planes for lw in t.w.layers for w in (lw.q, lw.k, lw.v, lw.o) if type(w) is QuantLinear}
            assert planes <= {2 if act == "int16" else 1} and t.compute.planes == (2 if act == "int16" else 1)
            logits[act] = _decode_logits(m, IDS)
    assert not torch.equal(logits["int8"], logits["int16"])
    assert _rel_l2(logits["int8"], exact) <= max(6e-2, 2 * _rel_l2(logits["int16"], exact)), name
    assert_streamed_equals_resident(path, IDS, "direct", False, "min", activations="int8")
