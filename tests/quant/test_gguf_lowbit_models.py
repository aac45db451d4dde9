"""Tiny GGUF models whose 2-D tensors (experts, attention, embeddings, head; not the norms and routers) are in each
of issue 32's types (random valid blocks written by the `gguf` package's writer, or its own quantization for TQ1_0 /
TQ2_0 / MXFP4): sluice loads them, its float32 logits are those of the weights `gguf.quants.dequantize` gives, and a
streamed run is bitwise the resident one. Their native kernels (issue 32 item 2: native/lowbit.c, q8_low.c) run every
expert from its stored bytes, a decode token's experts on the integer path, and keep the resident 2-D tensors in
their blocks at bf16 / f16 (QuantLinear); without the extension each projection dequantizes in torch (bitwise gguf)
and runs one float32 GEMM."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import sluice
from sluice.quant import native
from sluice.quant.spec import QuantSpec
from sluice.quant.tensor import read_tensor
from tests.checkpoint.gguf_files import GGUF_TINY, Q, convert, gguf
from tests.models.tiny import hf_model, write_checkpoint
from tests.quant.streaming import assert_streamed_equals_resident
from tests.quant.test_gguf_models import IDS, K_SHAPES, _decode_logits, _plain, _rel_l2, dequantized_reference

TYPES = ["Q2_K", "Q3_K", "TQ1_0", "TQ2_0", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
         "IQ4_NL", "IQ4_XS", "MXFP4"]


def gguf_read(ref) -> torch.Tensor:
    """A GGUF tensor's values as the `gguf` package dequantizes its bytes (plain tensors as sluice reads them)."""
    if not ref.quantized:
        return read_tensor(ref)
    assert ref.row_order() is None  # qwen3moe: no rows permuted for llama.cpp's rope
    raw = np.fromfile(ref.path, np.uint8, ref.nbytes, offset=ref.offset).reshape(-1, ref.row_nbytes)
    return torch.from_numpy(gguf.quants.dequantize(raw, Q[ref.dtype]).reshape(ref.shape))


@pytest.fixture(scope="module", params=TYPES)
def lowbit(request, tmp_path_factory):
    """(type name, {"experts": the experts in the type, the rest F32; "all": every 2-D tensor in it, norms and
    routers F32} -> (GGUF path, transformers model of gguf's dequantization of its weights), a folder to write in)."""
    qtype = Q[request.param]
    root = tmp_path_factory.mktemp(request.param)
    files = {}
    for which, pick in (("experts", lambda name: qtype if "_exps." in name else Q.F32),
                        ("all", lambda name: Q.F32 if _plain(name) else qtype)):
        model = hf_model("qwen3_moe", **{**GGUF_TINY["qwen3_moe"], **K_SHAPES})
        path = convert(model, root / f"{which}.gguf", qtype=pick)
        files[which] = path, dequantized_reference(model, path, read=gguf_read)
    return request.param, files, root


def test_float32_logits_are_the_gguf_dequantized_weights(lowbit):
    """Experts in the type (streamed from their blocks), and every 2-D tensor in it (the resident ones dequantized at
    load): the logits of the weights gguf's dequantization gives (transformers, and sluice on a plain folder), to
    float32 rounding (1e-5; measured 4e-7 to 1.2e-6 for every type and file)."""
    name, files, root = lowbit
    for which, (path, ref) in files.items():
        with torch.no_grad():
            want = ref(torch.tensor([IDS])).logits[0]
        with sluice.load(path, memory="all", dtype="float32") as m:
            got = m.logits(IDS)
            assert m.layout.plain_dtype is None and m.layout.format_names == [name]  # experts kept in their blocks
        assert _rel_l2(got, want) <= 1e-5, (name, which)
    folder = write_checkpoint(ref, root / "hf", "per_expert")  # the last file's weights, plain
    with sluice.load(folder, memory="all", dtype="float32") as m:
        assert _rel_l2(got, m.logits(IDS)) <= 1e-5, name


@pytest.mark.parametrize("which", ["experts", "all"])
def test_bf16_runs_streamed_bitwise_resident(lowbit, which, monkeypatch):
    """At bf16 (the default for a quantized file) a streamed run gives the resident run's bits, every projection of
    the type on native kernels (no torch dequantization of its bytes, counted). No tolerance against float32 here:
    these random models turn bf16 rounding into other experts (sluice's bf16 run of the IQ4_NL experts file is 0.18
    off the float32 logits with the native kernels as with the torch dequantization, transformers' bf16 run of the
    same weights 0.09); the kernels' accuracy is test_float16_runs_the_integer_path_within_the_float32_logits' and
    tests/quant/test_q8_low.py's."""
    name, files, _ = lowbit
    calls = []
    real = QuantSpec.dequantize

    def counted(self, *a, **k):
        calls.append(self.name)
        return real(self, *a, **k)
    monkeypatch.setattr(QuantSpec, "dequantize", counted)
    assert_streamed_equals_resident(files[which][0], IDS, "direct", True, "min", dtype="bfloat16")
    if native.available():
        assert name not in calls
    else:
        assert calls.count(name) > 0


def test_float16_runs_the_integer_path_within_the_float32_logits(lowbit, monkeypatch):
    """The experts file at float16 (the integer path runs at bf16 and f16; at f16 the rest of the model rounds 8x
    finer than at bf16, so the kernels' own error shows instead of these random models' routing flips): every
    decode step computes each expert as one native call on its one row (the integer path, activations int16), and
    the prompt's and the decode steps' logits are within test_gguf_models.py's bound of the float32 run on the
    file's dequantized weights (3e-2) and within 1.5x transformers' own float16 error on those weights (measured:
    sluice 2.1e-3 - 4.2e-3, 0.95x - 1.07x transformers' for every type)."""
    name, files, _ = lowbit
    if not native.available():
        pytest.skip("native kernels not built: no integer path")
    path, ref = files["experts"]
    with torch.no_grad():
        want = ref(torch.tensor([IDS])).logits[0]
        own = _rel_l2(copy.deepcopy(ref).to(torch.float16)(torch.tensor([IDS])).logits[0], want)
    with sluice.load(path, memory="all", dtype="float32") as m:
        exact = _decode_logits(m, IDS)
    rows = []  # x's rows, one entry per expert computed by a one-call kernel (one thread: __call__; more: many)
    call, many = native.ExpertCall.__call__, native.ExpertCall.many
    monkeypatch.setattr(native.ExpertCall, "__call__", lambda self, slot, x, *a, **k: (
        rows.append(x.shape[0]), call(self, slot, x, *a, **k))[1])
    monkeypatch.setattr(native.ExpertCall, "many", lambda self, raw, slots, x, *a, **k: (
        rows.extend([x.shape[0]] * len(slots)), many(self, raw, slots, x, *a, **k))[1])
    with sluice.load(path, memory="all", dtype="float16", activations="int16") as m:  # auto: int8 under 5.5 bits
        assert m.model.compute.planes == 2
        err = _rel_l2(m.logits(IDS), want)
        with torch.inference_mode():
            m.model.forward(torch.tensor(IDS[:4]), 0)
            rows.clear()
            m.model.forward(torch.tensor([IDS[4]]), 4)
        assert rows == [1] * (sum(m.spec.moe_layers) * m.spec.top_k)  # one integer-path call per expert
        dec = _rel_l2(_decode_logits(m, IDS), exact)
    assert err <= 3e-2 and err <= 1.5 * own, (name, err, own)
    assert dec <= 3e-2, (name, dec)
