"""Resident projections kept in their GGUF blocks (quant/linear.py QuantLinear): the kernels each row count runs,
the models that keep them, and the memory the plan counts for them."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

import sluice
from sluice import cli
from sluice.quant.tensor import read_tensor
from sluice.quant import linear, native
from sluice.quant.native import _lib
from sluice.quant.compute import Compute
from sluice.quant.linear import NATIVE_MAX_ROWS, Q8_MAX_ROWS, QuantLinear
from sluice.quant.spec import QuantSpec
from tests.quant.samples import random_stored
from tests.checkpoint.gguf_files import GGUF_TINY, Q, convert
from tests.models.tiny import hf_model
from tests.quant.test_native import check_close
from sluice.plan import open_index

built = pytest.mark.skipif(not native.native_available(),
                           reason="native kernels not built (pip install -e . with a C compiler builds them)")

# odd row counts; rows of whole blocks
SPECS = [QuantSpec.ggml(n, 37, 512 if n.endswith("K") else 96) for n in ("Q4_0", "Q8_0", "Q5_1", "Q4_K", "Q6_K")]


def _x(T: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(T, k, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def threads():
    """native.set_threads(n) (the C pool) for the test, back to one thread after it."""
    yield native.set_threads
    native.set_threads(1)


@built
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_few_rows_run_the_integer_path_bitwise_for_any_split(spec, threads):
    raw = random_stored(spec, seed=1)
    w = QuantLinear(spec, raw, Compute(torch.bfloat16))
    assert w.shape == (37, spec.in_features) and w.nbytes == spec.nbytes
    assert torch.equal(w.dequantize(), spec.dequantize(raw))
    assert torch.equal(w.dequantize((5, 20)), spec.dequantize(raw)[5:20])
    for T in range(1, Q8_MAX_ROWS + 1):
        x = _x(T, spec.in_features, T)
        want = native.linear_q8(spec, x, raw)  # [T, 37] float32
        assert torch.equal(native.LinearsQ8([(spec, raw)])(x)[0], want)
        assert torch.equal(w.linear(x, out_dtype=torch.float32), want)
        assert torch.equal(w.linear(x.bfloat16()), native.linear_q8(spec, x.bfloat16().float(), raw).bfloat16())
        for n in (2, 3):
            threads(n)  # the C pool the model's QuantLinears split their rows over
            assert torch.equal(w.linear(x, out_dtype=torch.float32), want)
            threads(1)


@built
@pytest.mark.parametrize("spec", SPECS[2:4], ids=lambda s: s.name)
def test_more_rows_run_the_float_row_kernel_then_blocks_of_dequantized_weights(spec, threads, monkeypatch):
    raw = random_stored(spec, seed=2)
    w = QuantLinear(spec, raw, Compute(torch.float16))
    exact = spec.dequantize(raw)  # [37, in] float32
    x = _x(NATIVE_MAX_ROWS, spec.in_features)
    want = native.linear(spec, x, raw)
    assert torch.equal(w.linear(x, out_dtype=torch.float32), want)
    threads(2)
    assert torch.equal(w.linear(x, out_dtype=torch.float32), want)
    threads(1)
    x = _x(NATIVE_MAX_ROWS + 9, spec.in_features)
    assert torch.equal(w.linear(x, out_dtype=torch.float32), F.linear(x, exact))  # one block: the same computation
    bias = torch.randn(37).half()
    assert torch.equal(w.linear(x.half(), bias), (F.linear(x.half().float(), exact) + bias.float()).half())
    monkeypatch.setattr(linear, "SCRATCH_BYTES", 5 * 4 * spec.in_features)  # blocks of 5 rows: 8 blocks
    w = QuantLinear(spec, raw, Compute(torch.float16))  # a fresh scratch
    y = w.linear(x, out_dtype=torch.float32)
    check_close(y, x, exact)  # within float32 dot-product error of the exact weights
    assert w.scratch.get(0).untyped_storage().nbytes() == 4 * 5 * spec.in_features  # never more than one block


@built
def test_bad_bytes_or_formats_are_refused():
    spec = SPECS[0]
    with pytest.raises(ValueError, match="stored bytes"):
        QuantLinear(spec, torch.zeros(spec.nbytes - 1, dtype=torch.uint8), Compute(torch.bfloat16))
    with pytest.raises(ValueError, match="GGUF blocks and FP8 weights"):
        QuantLinear(QuantSpec.mlx(4, 32, 8, 64), torch.zeros(1, dtype=torch.uint8), Compute(torch.bfloat16))


# -- models ----------------------------------------------------------------------------------------------------------
def _q(qtype):
    """Every 2-D tensor of the GGUF in `qtype` except norms, routers and biases (F32)."""
    return lambda n: Q.F32 if n.endswith(("norm.weight", "ffn_gate_inp.weight", ".bias")) else qtype


def _q4_k_m(n: str):
    return Q.Q6_K if n == "output.weight" or n.endswith("attn_v.weight") else _q(Q.Q4_K)(n)


MODELS = {  # name -> (arch, type of each GGUF tensor, config overrides)
    # K-quants, an untied Q6_K head
    "qwen3_moe-Q4_K_M": ("qwen3_moe", _q4_k_m, dict(hidden_size=256, moe_intermediate_size=256, head_dim=64)),
    # a shared expert and its [1, H] gate, q/k/v biases, a tied head (stays the embedding); rows of whole blocks
    "qwen2_moe-Q8_0": ("qwen2_moe", _q(Q.Q8_0), dict(moe_intermediate_size=32, shared_expert_intermediate_size=64)),
    # q/k rows stored permuted for llama.cpp's rope (restored on the stored blocks)
    "mixtral-Q4_0": ("mixtral", _q(Q.Q4_0), dict(intermediate_size=64)),
}
IDS = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module", params=list(MODELS))
def gguf(request, tmp_path_factory):
    arch, qtype, overrides = MODELS[request.param]
    model = hf_model(arch, **{**GGUF_TINY[arch], **overrides})
    return convert(model, tmp_path_factory.mktemp(request.param) / "m.gguf", qtype=qtype)


def _projections(w) -> dict:
    """name -> weight of every projection the model math runs through models/linear.py, and the others."""
    out = {"lm_head": w.lm_head, "embed": w.embed}
    for L, lw in enumerate(w.layers):
        for k in ("q", "k", "v", "o", "shared_gate", "router"):
            out[f"{L}.{k}"] = getattr(lw, k)
        for mlp in ("mlp", "shared"):
            if getattr(lw, mlp) is not None:
                out.update({f"{L}.{mlp}.{k}": getattr(getattr(lw, mlp), k) for k in ("gate", "up", "down")})
    return {k: v for k, v in out.items() if v is not None}


def _held(w) -> int:
    """Bytes the Weights struct holds (the tied head counted once)."""
    seen, total = set(), 0
    for t in [w.embed, w.norm, w.lm_head, *(v for lw in w.layers for v in vars(lw).values())]:
        for x in (vars(t).values() if dataclasses.is_dataclass(t) else (t,)):  # MLPWeights
            if x is not None and id(x) not in seen:
                seen.add(id(x))
                total += x.nbytes if isinstance(x, QuantLinear) else x.numel() * x.element_size()
    return total


@built
def test_default_dtype_keeps_the_quantized_projections_as_stored(gguf, capsys):
    with sluice.load(gguf, memory="all", dtype="float32") as m:
        exact = {k: v.clone() for k, v in _projections(m.model.w).items()}  # the file's dequantization, HF rows
        assert all(isinstance(v, torch.Tensor) for v in exact.values())  # float32 keeps plain tensors
        want, f32_bytes = m.logits(IDS), m.resident_bytes
        assert f32_bytes == _held(m.model.w)
    with sluice.load(gguf, memory="all", activations="int16") as m:  # the 3e-2 below is int16's (int8: ~4e-2)
        got = _projections(m.model.w)
        logits, resident_bytes = m.logits(IDS), m.resident_bytes
        held = _held(m.model.w)
        tied = m.spec.tie_word_embeddings
    quant = {k for k, v in got.items() if isinstance(v, QuantLinear)}
    # all but the embedding, the routers, a tied head and the shared expert's gate (1-D [H] in a GGUF file: F32)
    plain = ("embed", "router", "shared_gate")
    assert quant == {k for k in got if k.split(".", 1)[-1] not in plain and not (tied and k == "lm_head")}
    for k in quant:  # the stored rows in Hugging Face order (mixtral's q/k un-permuted), their exact values
        assert torch.equal(got[k].dequantize().view_as(exact[k]), exact[k]), k
    assert all(type(got[k]) is torch.Tensor and got[k].dtype == torch.bfloat16 for k in got.keys() - quant)
    # the memory counted is the memory held: stored bytes for the kept projections
    assert resident_bytes == held < f32_bytes // 2
    assert cli.main(["inspect", str(gguf), "--json", "--usage-tokens", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["resident_bytes"] == resident_bytes
    err = ((logits - want).norm() / want.norm()).item()
    assert err <= 3e-2, err


@built
def test_without_the_native_kernels_every_weight_is_a_tensor(gguf, monkeypatch):
    index = open_index(gguf)
    monkeypatch.setattr(_lib, "LIB", None)  # as after an install without a C compiler
    with sluice.load(gguf, memory="all") as m:
        w = _projections(m.model.w)
        assert all(type(v) is torch.Tensor and v.dtype == torch.bfloat16 for v in w.values())
        assert torch.equal(w["0.o"], read_tensor(index["model.layers.0.self_attn.o_proj.weight"], torch.bfloat16))
