"""QuantSpec / kernel_for / prepare / linear, and torch's int4 layout written by our packer."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from sluice.quant import int4pack
from sluice.checkpoint.formats import UnsupportedFormat
from sluice.quant.kernels import INT4_MAX_ROWS, QuantSpec, kernel_for
from tests.quant.samples import random_stored

# the default dtype's tolerance: issue 14 allows 3e-2 relative L2 for the default dtype; the packed int4 op measures
# ~3e-3 here (bf16 scales / zeros and bf16 activations), so 1e-2 still catches a wrong layout or zero point
PACKED_RTOL = 1e-2

SPECS = [QuantSpec.ggml(name, 48, 512) for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K",
                                                    "MXFP4", "F32", "F16", "BF16")]
SPECS += [QuantSpec.mlx(bits, group, 48, 256, scale_dtype) for bits, group, scale_dtype in
          [(4, 32, torch.bfloat16), (4, 64, torch.float16), (4, 128, torch.float32), (8, 64, torch.bfloat16),
           (3, 32, torch.bfloat16), (2, 64, torch.bfloat16), (6, 64, torch.bfloat16)]]
SPECS += [QuantSpec.mxfp4(48, 256)]


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def prepared(spec: QuantSpec, dtype: torch.dtype, seed: int = 0):
    raw = random_stored(spec, seed)
    k = kernel_for(spec, dtype)
    slot = k.prepare(raw, torch.empty(k.nbytes, dtype=torch.uint8))
    return raw, k, slot, torch.empty(k.scratch_numel)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_float32_is_the_exact_dequantization(spec):
    raw, k, slot, scratch = prepared(spec, torch.float32)
    w = spec.dequantize(raw)
    x = torch.randn(5, spec.in_features)
    assert k.name in ("affine", "plain")
    assert torch.equal(k.dequantize(slot, scratch), w)
    assert torch.equal(k.linear(x, slot, scratch), F.linear(x, w))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("rows", [1, 4, INT4_MAX_ROWS + 3])
def test_bfloat16_is_within_the_stated_tolerance(spec, rows):
    raw, k, slot, scratch = prepared(spec, torch.bfloat16)
    x = torch.randn(rows, spec.in_features).bfloat16()
    y = k.linear(x, slot, scratch)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, spec.out_features)
    assert rel(y, F.linear(x.float(), spec.dequantize(raw))) < PACKED_RTOL


def test_kernel_choice_per_format_and_dtype():
    def kind(spec, dtype=torch.bfloat16):
        return kernel_for(spec, dtype).name
    for name in ("Q4_0", "Q4_1", "Q4_K"):
        assert kind(QuantSpec.ggml(name, 64, 256)) == "int4pack"
        assert kind(QuantSpec.ggml(name, 64, 256), torch.float32) == "affine"
    for name in ("Q5_0", "Q5_1", "Q8_0", "Q5_K", "Q6_K", "MXFP4"):
        assert kind(QuantSpec.ggml(name, 64, 256)) == "affine"
    assert kind(QuantSpec.ggml("BF16", 64, 256)) == "plain"
    assert kind(QuantSpec.mlx(4, 64, 64, 256)) == "int4pack"
    assert kind(QuantSpec.mlx(8, 64, 64, 256)) == "affine"
    assert kind(QuantSpec.ggml("Q4_K", 40, 256)) == "affine"  # the op packs rows in blocks of 16


def test_prepare_reuses_the_slot_and_is_deterministic():
    spec = QuantSpec.ggml("Q4_K", 80, 512)  # 80 rows: full int4 row blocks and a tail
    for dtype in (torch.bfloat16, torch.float32):
        raw_a, raw_b = random_stored(spec, 1), random_stored(spec, 2)
        k = kernel_for(spec, dtype)
        slot = torch.empty(k.nbytes, dtype=torch.uint8)
        ptr = slot.data_ptr()
        k.prepare(raw_a, slot)
        k.prepare(raw_b, slot)  # overwrite in place with another expert
        assert slot.data_ptr() == ptr
        fresh = k.prepare(raw_b, torch.empty(k.nbytes, dtype=torch.uint8))
        assert torch.equal(slot, fresh)
        x = torch.randn(3, 512).to(dtype)
        scratch = torch.empty(k.scratch_numel)
        assert torch.equal(k.linear(x, slot, scratch), k.linear(x, fresh, scratch))


def test_int4_op_and_its_dequantized_path_compute_the_same_weights():
    spec = QuantSpec.ggml("Q4_K", 64, 512)
    raw, k, slot, scratch = prepared(spec, torch.bfloat16)
    w = k.dequantize(slot, scratch).clone()  # the bf16-scaled weights both paths use
    exact = spec.dequantize(raw)
    assert 0 < rel(w, exact) < 5e-3  # scales and zeros rounded to bf16
    x = torch.randn(2, 512).bfloat16()
    assert rel(k.linear(x, slot, scratch), F.linear(x.float(), w)) < 5e-3


def test_spec_parts_and_errors():
    s = QuantSpec.mlx(4, 64, 10, 256, torch.bfloat16)
    assert [(p.name, p.offset, p.nbytes) for p in s.parts] == [("weight", 0, 1280), ("scales", 1280, 80),
                                                               ("biases", 1408, 80)]
    assert s.nbytes == 1488
    assert QuantSpec.ggml("Q4_K", 3, 512).nbytes == 3 * 288
    with pytest.raises(UnsupportedFormat, match="Q2_K"):
        QuantSpec.ggml("Q2_K", 8, 256)
    with pytest.raises(UnsupportedFormat, match="FP8"):
        QuantSpec.ggml("FP8", 8, 256)
    with pytest.raises(ValueError, match="whole blocks"):
        QuantSpec.ggml("Q4_K", 8, 128)
    with pytest.raises(ValueError, match="bits=7"):
        QuantSpec.mlx(7, 64, 8, 256)
    k = kernel_for(QuantSpec.ggml("Q8_0", 8, 64), torch.float32)
    with pytest.raises(ValueError, match="slot must be"):
        k.prepare(torch.zeros(8 * 68, dtype=torch.uint8), torch.empty(k.nbytes - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="compute dtype"):
        kernel_for(QuantSpec.ggml("Q8_0", 8, 64), torch.float64)


@pytest.mark.parametrize("n", [16, 32, 48, 64, 80, 96, 784])
def test_our_int4_packing_is_the_ops_layout(n):
    if not int4pack.layout_known():
        pytest.skip(f"int4 layout of {torch.backends.cpu.get_cpu_capability()} is not known")
    codes = torch.randint(0, 16, (n, 64), dtype=torch.uint8)
    out = torch.empty(n, 32, dtype=torch.uint8)
    assert int4pack.pack_codes(codes, out) is out
    assert torch.equal(out, torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))


@pytest.mark.parametrize("layout", ["avx2", "avx512", "pairs"])
def test_every_int4_layout_round_trips(layout):
    codes = torch.randint(0, 16, (784, 96), dtype=torch.uint8)
    packed = torch.empty(784, 48, dtype=torch.uint8)
    int4pack._pack(int4pack._pairs(codes), packed, layout)
    assert torch.equal(int4pack.unpack_codes(packed, 96, layout=layout), codes)


def test_plain_cpu_kernel_layout_matches_the_op():
    # ATEN_CPU_CAPABILITY=default makes torch dispatch its unvectorised kernel, whose layout is the "pairs" one
    code = ("import torch; from sluice.quant import int4pack as p; assert p._layout() == 'pairs', p._layout(); "
            "c = torch.randint(0, 16, (80, 64), dtype=torch.uint8); "
            "assert torch.equal(p.pack_codes(c), torch.ops.aten._convert_weight_to_int4pack_for_cpu(c.int(), 1))")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_an_unknown_int4_layout_falls_back_to_the_op(monkeypatch):
    spec = QuantSpec.ggml("Q4_K", 48, 512)
    raw = random_stored(spec, 3)
    k = kernel_for(spec, torch.bfloat16)
    ours = k.prepare(raw, torch.empty(k.nbytes, dtype=torch.uint8))
    known = int4pack.layout_known()
    monkeypatch.setattr(int4pack, "_layout", lambda: "op")
    theirs = k.prepare(raw, torch.empty(k.nbytes, dtype=torch.uint8))
    if known:
        assert torch.equal(ours, theirs)
    x = torch.randn(INT4_MAX_ROWS + 1, 512).bfloat16()  # many rows: the op, since the layout cannot be read back
    y = k.linear(x, theirs, torch.empty(k.scratch_numel))
    assert rel(y, F.linear(x.float(), spec.dequantize(raw))) < PACKED_RTOL
    with pytest.raises(ValueError, match="unknown to sluice"):
        k.dequantize(theirs, torch.empty(k.scratch_numel))
