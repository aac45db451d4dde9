"""A decode step's fused native calls, on a file sluice's own quantizer writes (no llama.cpp needed): a tiny
qwen3_5_moe (Gated DeltaNet and gated attention layers, a shared expert of the routed experts' shape) in Q8_0.

- each mixer in one native call (native/layer.c: DeltaNetFused, AttentionFused): bitwise the separate calls;
- the shared expert as one more expert of the routed experts' call (MoE._fused_shared): once a layer, bitwise with
  split_experts off, within bf16's reach of the separate DenseMLP;
- streamed == resident bitwise with all of them (the shared expert alone in the first call while the misses load).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")

import sluice  # noqa: E402
from sluice.models.layers import Kernels  # noqa: E402
from sluice.models.layers.build import Step  # noqa: E402
from sluice.models.layers.gated_attention import GatedAttention  # noqa: E402
from sluice.models.layers.gated_deltanet import GatedDeltaNet  # noqa: E402
from sluice.models.layers.moe import MoE  # noqa: E402
from sluice.quant import native  # noqa: E402
from sluice.quant.native.moe_decode import DecodeExperts  # noqa: E402
from sluice.store.base import ExpertBatch  # noqa: E402
from tests.models.tiny import q8_qwen35_gguf  # noqa: E402
from tests.quant.streaming import assert_streamed_equals_resident  # noqa: E402

pytestmark = pytest.mark.skipif(not native.available(), reason="the native extension is not built")
IDS = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    return q8_qwen35_gguf(tmp_path_factory.mktemp("fused"), num_experts=4)


def _decode_logits(m, ids: list[int]) -> torch.Tensor:
    """Logits of each decode step (T == 1) after a prompt of all but the last 8 ids, [8, V] float32."""
    with torch.inference_mode():
        m.model.forward(torch.tensor(ids[:-8]), 0)
        return torch.cat([m.model.logits(m.model.forward(torch.tensor([t]), p)).float()
                          for p, t in enumerate(ids[-8:], len(ids) - 8)])


def test_each_mixer_is_one_call_bitwise(q8_file):
    with sluice.load(q8_file, threads=2) as m:
        mixers = [layer.mixer for layer in m.model.layers if hasattr(layer, "mixer")]
        delta = [g for g in mixers if isinstance(g, GatedDeltaNet)]
        attn = [g for g in mixers if isinstance(g, GatedAttention)]
        assert delta and attn and all(g.fused is not None for g in delta + attn)
        one = _decode_logits(m, IDS)
        for g in delta + attn:
            g.fused = None
        assert torch.equal(_decode_logits(m, IDS), one)


def test_the_shared_expert_rides_the_routed_experts_call(q8_file, monkeypatch):
    extras = []
    run = DecodeExperts.run  # a decode token's block (layers/moe_decode.py): its first call computes the shared
    monkeypatch.setattr(DecodeExperts, "run", lambda self, *a: (extras.append(a[5] and self._extra is not None),
                                                                run(self, *a))[1])
    with sluice.load(q8_file, threads=2) as m:
        assert all(layer.ffn.fused is not None and layer.ffn.decode is not None for layer in m.model.layers)
        with torch.inference_mode():
            m.model.forward(torch.tensor(IDS[:-1]), 0)
            extras.clear()
            m.model.forward(torch.tensor(IDS[-1:]), len(IDS) - 1)
        assert sum(extras) == sum(m.spec.moe_layers)  # once a layer
        fused = _decode_logits(m, IDS)
        m.model = m.model.rebuilt(Kernels(split_experts=False))  # moe.py's path, one expert call each
        assert all(layer.ffn.decode is None for layer in m.model.layers)
        assert torch.equal(_decode_logits(m, IDS), fused)
        # one block on one x both ways: the shared term's arithmetic differs (float32 vs DenseMLP's bf16 steps), so
        # the outputs differ, by bf16's precision (the logits of so small a model may not show it at all)
        x = torch.randn(1, m.spec.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        with torch.inference_mode():
            outs = []
            for moe in [layer.ffn for layer in m.model.layers]:
                a = moe(x, Step(0, 1))
                (moe.fused, moe.decode), keep = (None, None), (moe.fused, moe.decode)
                outs.append((a.float(), moe(x, Step(0, 1)).float()))
                moe.fused, moe.decode = keep
        rel = max(((a - b).abs().max() / b.abs().max()).item() for a, b in outs)
        assert 0 < rel < 3e-2, rel
    monkeypatch.setattr(MoE, "_fused_shared", lambda self, b: None)
    with sluice.load(q8_file, threads=2) as m:
        separate = _decode_logits(m, IDS)
    rel = ((fused - separate).abs().amax(1) / separate.abs().amax(1)).max().item()
    assert rel < 3e-2, rel


@pytest.mark.parametrize("io,odirect", [("direct", False), ("direct", True), ("mmap", False)])
def test_streamed_equals_resident(q8_file, io, odirect):
    assert_streamed_equals_resident(q8_file, IDS[:20], io, odirect, "min")


def test_the_decode_block_is_moe_py_bitwise_resident_and_streamed(q8_file, monkeypatch):
    """A decode token's MoE block in two native calls (layers/moe_decode.py MoEDecode) against moe.py's one-token
    path it replaces: the same logits, bit for bit, resident; streamed at the smallest cache its late experts go in
    calls of their own as their reads land (the sum with the last) and still give the resident logits."""
    with sluice.load(q8_file, threads=2) as m:
        blocks = [layer.ffn for layer in m.model.layers]
        assert all(b.decode is not None for b in blocks)
        two_calls = _decode_logits(m, IDS)
        for b in blocks:
            b.decode = None
        assert torch.equal(_decode_logits(m, IDS), two_calls)
        resident, k, nbytes = m.resident_bytes, m.spec.top_k, m.layout.expert_nbytes
    sums = []
    run = DecodeExperts.run
    monkeypatch.setattr(DecodeExperts, "run", lambda self, *a: (sums.append(len(a) > 6 and a[6] > 0), run(self, *a))[1])
    # a read counts as landed only once waited for: so small a model's reads often land before the block looks
    monkeypatch.setattr(ExpertBatch, "arrived", lambda self, j: j not in self.pending)
    with sluice.load(q8_file, threads=2, memory=resident + k * nbytes, io="direct") as m:
        assert all(layer.ffn.decode is not None for layer in m.model.layers)
        assert torch.equal(_decode_logits(m, IDS), two_calls)
    assert sums.count(False) > 0 and sums.count(True) == 8 * 4  # calls without the sum: late experts; one sum a layer
