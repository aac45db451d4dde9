"""QuantSpec: the parts of a projection's stored bytes, its exact dequantization, and the errors for what it refuses."""

from __future__ import annotations

import pytest
import torch

from sluice.checkpoint.formats import UnsupportedFormat
from sluice.quant import ggml
from sluice.quant.spec import QuantSpec
from tests.quant.samples import random_stored


def test_spec_parts_and_errors():
    s = QuantSpec.mlx(4, 64, 10, 256, torch.bfloat16)
    assert [(p.name, p.offset, p.nbytes) for p in s.parts] == [("weight", 0, 1280), ("scales", 1280, 80),
                                                               ("biases", 1408, 80)]
    assert s.nbytes == 1488
    assert QuantSpec.ggml("Q4_K", 3, 512).nbytes == 3 * 288
    with pytest.raises(UnsupportedFormat, match="Q8_K"):
        QuantSpec.ggml("Q8_K", 8, 256)
    with pytest.raises(UnsupportedFormat, match="FP8"):
        QuantSpec.ggml("FP8", 8, 256)
    with pytest.raises(ValueError, match="whole blocks"):
        QuantSpec.ggml("Q4_K", 8, 128)
    with pytest.raises(ValueError, match="bits=7"):
        QuantSpec.mlx(7, 64, 8, 256)


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "F16", "BF16"])
def test_dequantize_is_the_block_formats_reference(name):
    spec = QuantSpec.ggml(name, 8, 256)
    raw = random_stored(spec, seed=3)
    want = ggml.dequantize(raw.view(8, -1), name, shape=(8, 256))
    assert torch.equal(spec.dequantize(raw), want)
    out = torch.empty(8, 256)
    spec.dequantize(raw, out=out)
    assert torch.equal(out, want)
