"""The Gated DeltaNet hybrids as llama.cpp's own converter writes them (qwen3next, qwen35moe): convert_hf_to_gguf.py
(tests/checkpoint/llama_cpp.py) on tiny random transformers checkpoints, then sluice on the GGUF against transformers
(F32: the converter's renames, its +1 norms, -exp(A_log), squeezed conv and tiled value heads undone) and against
llama.cpp's greedy tokens on its own Q8_0 and Q4_K_M files; streamed == resident bitwise on them.

The checkpoints: tests/checkpoint/hybrid_files.py (shapes llama.cpp runs). Its converter needs --no-mtp for a
checkpoint without an mtp head (these)."""

from __future__ import annotations

import pytest
import torch

import sluice
from sluice.checkpoint.gguf_index import GGUFIndex
from sluice.models.layers import Kernels
from sluice.models.layers.moe import MoE
from sluice.plan import open_index
from sluice.quant.tensor import read_tensor
from tests.checkpoint import llama_cpp
from tests.checkpoint.hybrid_files import (GGUF_ARCH, K_SHAPES, LLAMA_TINY, LONG, SHORT, assert_native_deltanet,
                                          hf_folder, tiled_state_dict)
from tests.quant.streaming import assert_streamed_equals_resident

pytestmark = pytest.mark.llama_cpp
FP32_REL = 1e-4  # relative to the largest logit, as tests/models/test_hybrid.py

# a bf16 run's greedy tokens may part from llama.cpp's (which computes in float32) at a near tie: the two candidates'
# logits closer than this fraction of the logits' range in the file's exact model (its float32 dequantization, whose
# greedy tokens are llama.cpp's), ids of a 256-wide random model. (It asked for the bf16 run's own prompt logits and no
# parting before the 8th token; a decode step whose shared expert computes silu(g) * u in float32, as llama.cpp does,
# parted at the 5th token of the Q4_K_M qwen3_5_moe file, where the exact logits of the two were 0.0055 apart, 0.19% of
# their range, and its logits were closer to the exact ones than before: 9.3e-3 against 9.9e-3 of the largest, mean
# over 16 steps.)
NEAR_TIE = 0.01


@pytest.fixture(scope="module", params=list(GGUF_ARCH))
def f32(request, tmp_path_factory):
    """(arch, transformers model, its HF folder, the F32 GGUF llama.cpp's converter writes of it)."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    folder, model = hf_folder(arch, root, **LLAMA_TINY[arch])
    return arch, model, folder, llama_cpp.convert(folder, root / "m-f32.gguf")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out - ref).abs().max().item() / ref.abs().max().item()


def test_f32_logits_match_transformers(f32):
    arch, model, _, path = f32
    index = open_index(path)
    assert isinstance(index, GGUFIndex) and index.arch == GGUF_ARCH[arch]
    for ids in (SHORT, LONG):
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0]
        for chunk in ("auto", 50):  # one pass; passes that split the delta rule's 64-token blocks
            with sluice.load(path, dtype="float32", prefill_chunk=chunk) as m:
                got = m.logits(ids)
            assert rel_err(got, want) <= FP32_REL, (arch, len(ids), chunk, rel_err(got, want))


def test_every_tensor_reads_as_transformers_wrote_it_in_the_files_head_order(f32):
    """Names, values and shapes undone to transformers' (norms minus the converter's +1, A_log from -exp(A_log)),
    with llama.cpp's order of the value heads kept (qwen35moe: tiled), which the config says (the model runs in it);
    Qwen3-Next's fused in_proj_qkvz arrives split into q | k | v and z."""
    arch, model, _, path = f32
    index = open_index(path)
    cfg = model.config.get_text_config()
    nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    tiled = arch == "qwen3_5_moe"
    assert index.config.get("linear_value_head_order", "grouped") == ("tiled" if tiled else "grouped")
    sd = {k.replace("model.language_model.", "model."): v for k, v in model.state_dict().items()}
    if tiled:
        sd = tiled_state_dict(sd, nk, nk * dk, dv)
    checked = 0
    for name, want in sd.items():
        if ".experts." in name or "visual" in name or "rotary" in name or (name == "lm_head.weight"
                                                                           and name not in index):
            continue  # experts: stacked (the logits check them); a tied head: the embedding
        p, _, leaf = name.rpartition(".linear_attn.")
        if leaf == "in_proj_qkvz.weight":  # per key head q, k, r v, r z -> q | k | v and z
            g = want.view(nk, 2 * dk + 2 * (nv // nk) * dv, -1)
            q, k, v, z = g.split([dk, dk, nv // nk * dv, nv // nk * dv], dim=1)
            parts = {"in_proj_qkv.weight": torch.cat([x.reshape(-1, g.shape[-1]) for x in (q, k, v)]),
                     "in_proj_z.weight": z.reshape(-1, g.shape[-1])}
        else:
            parts = {leaf or name: want}
        for part, value in parts.items():
            full = f"{p}.linear_attn.{part}" if p else part
            got = read_tensor(index[full]).reshape(value.shape)
            if part.endswith(("norm.weight", "A_log")) and part != "norm.weight":  # not the gated norm's
                torch.testing.assert_close(got, value, rtol=1e-6, atol=1e-7, msg=full)  # (w + 1) - 1, log(exp(w))
            else:
                assert torch.equal(got, value), full
            checked += 1
    assert checked > 20


IO_MODES = [("mmap", False), ("willneed", False), ("direct", False), ("direct", True)]


@pytest.mark.parametrize("io,odirect", IO_MODES)
def test_streamed_equals_resident_bitwise(f32, io, odirect):
    _, _, _, path = f32
    assert_streamed_equals_resident(path, LONG[:80], io, odirect, "min")


def test_llama_cpp_agrees_with_transformers_on_the_f32_file(f32):
    """The reference check first (REFERENCES.md): llama.cpp's greedy tokens on the F32 file are transformers'; then
    sluice's, decoding on the native step in the file's order of the value heads (qwen35moe: tiled)."""
    arch, model, _, path = f32
    ids = LONG[:100]
    ref = llama_cpp.greedy(path, ids, 12)
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert ref["tokens"] == want[0, len(ids):].tolist(), arch
    with sluice.load(path, dtype="float32") as m:
        assert_native_deltanet(m, tiled=arch == "qwen3_5_moe")
        assert list(m.generate_tokens(ids, max_tokens=12, stop_at_eos=False)) == ref["tokens"]


@pytest.fixture(scope="module", params=[(a, q) for a in GGUF_ARCH for q in ("Q8_0", "Q4_K_M")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def quantized(request, tmp_path_factory):
    """(arch, kind, GGUF quantized by llama.cpp's own quantizer from its converter's F32 file of a 256-wide model)."""
    arch, kind = request.param
    root = tmp_path_factory.mktemp(f"{arch}-{kind}")
    folder, _ = hf_folder(arch, root, **K_SHAPES[arch])
    f32_path = llama_cpp.convert(folder, root / "m-f32.gguf")
    return arch, kind, llama_cpp.quantize(f32_path, root / f"m-{kind}.gguf", kind)


def test_quantized_files_give_llama_cpps_greedy_tokens(quantized):
    arch, kind, path = quantized
    index = open_index(path)
    types = {ref.dtype for ref in index.tensors.values()}
    assert (kind == "Q8_0" and "Q8_0" in types) or (kind == "Q4_K_M" and "Q4_K" in types), types
    ids = LONG[:100]
    ref = llama_cpp.greedy(path, ids, 16)["tokens"]
    with sluice.load(path) as m:  # bf16 and the integer kernels: llama.cpp's tokens up to a near tie
        assert_native_deltanet(m, tiled=arch == "qwen3_5_moe")
        got = list(m.generate_tokens(ids, max_tokens=16, stop_at_eos=False))
    with sluice.load(path, dtype="float32") as m:  # the file's exact dequantization: llama.cpp's tokens
        assert_native_deltanet(m, tiled=arch == "qwen3_5_moe")  # the decode steps below run on it
        assert list(m.generate_tokens(ids, max_tokens=16, stop_at_eos=False)) == ref, (arch, kind)
        at = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        if at is not None:  # where they part, the exact model's two candidates are within bf16's reach
            logits = m.logits(ids + ref[:at])[-1]
            gap = float(logits[ref[at]] - logits[got[at]])
            assert 0 <= gap <= NEAR_TIE * float(logits.max() - logits.min()), (arch, kind, at, gap)


@pytest.mark.parametrize("io,odirect", IO_MODES)
def test_quantized_streamed_equals_resident_bitwise(quantized, io, odirect):
    """In the default dtype: the K-quant and Q8_0 blocks kept and run by the integer kernels, streamed alike."""
    _, _, path = quantized
    assert_streamed_equals_resident(path, LONG[:80], io, odirect, "min")


def _decode_logits(m, ids: list[int]) -> torch.Tensor:
    """Logits of each decode step (T == 1) after a prompt of all but the last 8 ids, [8, V] float32."""
    with torch.inference_mode():
        m.model.forward(torch.tensor(ids[:-8]), 0)
        return torch.cat([m.model.logits(m.model.forward(torch.tensor([t]), p)).float()
                          for p, t in enumerate(ids[-8:], len(ids) - 8)])


def test_decode_computes_the_shared_expert_in_the_routed_experts_call(quantized, monkeypatch):
    """A decode step's shared expert (of the routed experts' [I, H], in integer formats) is one more expert of each
    layer's experts call (MoE._fused_shared; DecodeExperts.run), not three calls of its own; its logits agree with the separate
    DenseMLP's (which rounds g, u and their product to bf16) to bf16's precision, and are bitwise the same with
    split_experts off (one expert_q8 call an expert, the shared one included)."""
    from sluice.quant.native.moe_decode import DecodeExperts

    _, _, path = quantized
    ids = LONG[:40]
    extras = []
    run = DecodeExperts.run  # a decode token's block (layers/moe_decode.py): its first call computes the shared
    monkeypatch.setattr(DecodeExperts, "run", lambda self, *a: (extras.append(a[5] and self._extra is not None),
                                                                run(self, *a))[1])
    with sluice.load(path, threads=2) as m:
        with torch.inference_mode():
            m.model.forward(torch.tensor(ids[:-1]), 0)
            extras.clear()
            m.model.forward(torch.tensor(ids[-1:]), len(ids) - 1)
        assert sum(extras) == sum(m.spec.moe_layers), extras  # once a layer
        fused = _decode_logits(m, ids)
        m.model = m.model.rebuilt(Kernels(split_experts=False))
        assert torch.equal(_decode_logits(m, ids), fused)
    monkeypatch.setattr(MoE, "_fused_shared", lambda self, b: None)
    with sluice.load(path, threads=2) as m:
        separate = _decode_logits(m, ids)
    rel = ((fused - separate).abs().amax(1) / separate.abs().amax(1)).max().item()
    assert 0 < rel < 3e-2, rel  # each within ~1.3e-2 of the exact logits here (Q4_K_M)


def test_decode_runs_a_mixer_in_one_call_bitwise(quantized):
    """A decode token's mixer on kept-quantized projections is one native call: Qwen3.5's Gated DeltaNet
    (DeltaNetFused: the grouped input projections, the step, out_proj) and both families' gated attention
    (AttentionFused: q / k / v, the core, o_proj): the same logits, bit for bit, as the separate calls with Python
    between them."""
    from sluice.models.layers.gated_attention import GatedAttention
    from sluice.models.layers.gated_deltanet import GatedDeltaNet

    arch, _, path = quantized
    ids = LONG[:40]
    with sluice.load(path, threads=2) as m:
        mixers = [layer.mixer for layer in m.model.layers if hasattr(layer, "mixer")]
        delta = [g for g in mixers if isinstance(g, GatedDeltaNet) and g.native is not None]
        attn = [g for g in mixers if isinstance(g, GatedAttention)]
        fused = [g for g in delta + attn if g.fused is not None]
        # every attention layer; Qwen3.5's DeltaNet layers (Qwen3-Next's input projections come fused in its files)
        assert len(fused) == len(attn) + (len(delta) if arch == "qwen3_5_moe" else 0) and delta and attn
        one = _decode_logits(m, ids)
        for g in fused:
            g.fused = None
        assert torch.equal(_decode_logits(m, ids), one)


def test_a_file_with_the_mtp_head_runs_the_same(tmp_path):
    """Converted without --no-mtp (a hub checkpoint's multi-token-prediction head kept, as blocks after the model's:
    nextn_predict_layers), the file opens as the same model, its head listed and never read."""
    from sluice.tools.synth import SynthConfig, make_model

    sc = SynthConfig(arch="qwen3_5_moe", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                     num_experts=4, top_k=2, moe_intermediate_size=32, vocab_size=300, dtype="float32")
    folder = make_model(tmp_path / "m", sc, progress=False)
    plain = llama_cpp.convert(folder, tmp_path / "plain.gguf")
    with_mtp = llama_cpp.convert(folder, tmp_path / "mtp.gguf", no_mtp=False)
    index = open_index(with_mtp)
    assert index.config["num_hidden_layers"] == 4 and index.metadata["qwen35moe.nextn_predict_layers"] == 1
    head = [n for n in index.tensors if n.startswith("blk.4.")]
    assert head and all(index[n].name == n for n in head)
    with sluice.load(plain, dtype="float32") as m:
        want = m.logits(SHORT)
    with sluice.load(with_mtp, dtype="float32") as m:
        assert torch.equal(m.logits(SHORT), want)
