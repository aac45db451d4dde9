"""A prompt's Q4_K projections on 8-bit activations (sluice/quant/native/prompt.c, activations "int8").

The kernel against its definition: x coded as llama.cpp's Q8_K (per 256 values D = amax / 127, codes rint(x * 127 /
amax)) times the exact Q4_K weights, in float64 (relative L2 <= 1e-6: only float32 rounding differs); the AVX512-VNNI
and the portable path give the same bits, as do any T, thread count and output stride. In a model: a prompt's
experts take it at activations "int8", its logits stay near the float32 run's, and a streamed run gives the
resident run's bits. Where the CPU lacks AVX512-VNNI the model tests still run the kernel (its portable path, forced).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sluice
from sluice.quant import native
from sluice.quant.spec import QuantSpec
from sluice.models.layers import Kernels
from sluice.models.layers.experts import GluMath
from sluice.quant.native import pool, prompt
from tests.quant.samples import random_stored
from tests.checkpoint.gguf_files import GGUF_TINY, convert
from tests.models.tiny import hf_model
from tests.quant import paths
from tests.quant.streaming import assert_streamed_equals_resident
from tests.quant.test_gguf_models import K_SHAPES, q4_k_m

pytestmark = pytest.mark.skipif(not native.native_available(),
                                reason="native kernels not built (pip install -e . with a C compiler builds them)")


def coded(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] as the kernel codes it (float32 operations as prompt.c does them), decoded: codes times D."""
    t, k = x.shape
    xb = x.float().view(t, k // 256, 256)
    amax = xb.abs().amax(-1, keepdim=True)
    # a true division (torch's 127.0 / t is 127 * reciprocal(t), an ulp off now and then: a tie rounds otherwise)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return ((xb * inv).clamp(-127, 127).round() * (amax / 127.0)).view(t, k)


def run(spec, raw, x, path: str, monkeypatch, threads: int = 2) -> torch.Tensor:
    code = paths.code(path)
    old = pool.threads()
    pool.set_threads(threads)
    try:
        y = torch.empty(x.shape[0], spec.out_features)
        prompt.linears([(spec, raw, y)], x, path=code)
    finally:
        pool.set_threads(old)
    return y


def tile_paths() -> list[str]:
    """The paths of prompt.c's tiles this CPU runs: AVX512-VNNI ("best") where it has it, and the portable one (an
    AVX2-only CPU runs the portable tiles: prompt.c has no AVX2 code but the bf16 rounding, tested below)."""
    return ["best", "portable"] if prompt.available() else ["portable"]


SHAPES = [(37, 768, 17), (64, 1024, 8), (48, 512, 3), (16, 256, 1), (300, 512, 9)]


def _case(shape):
    n, k, t = shape
    spec = QuantSpec.ggml("Q4_K", n, k)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(k)) * torch.rand(k) * 4  # uneven channels
    return spec, random_stored(spec, seed=n), x


@pytest.mark.parametrize("path", ["best", "portable"])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_is_its_definition_on_every_path(shape, path, monkeypatch):
    spec, raw, x = _case(shape)
    y, yb = (run(spec, raw, xx, path, monkeypatch) for xx in (x, x.bfloat16()))
    ref = coded(x).double() @ spec.dequantize(raw).double().T
    assert float((y.double() - ref).norm() / ref.norm()) <= 1e-6
    bref = coded(x.bfloat16().float()).double() @ spec.dequantize(raw).double().T
    assert float((yb.double() - bref).norm() / bref.norm()) <= 1e-6
    # against the exact product: the coding's error, about llama.cpp's (test_q8.py's K-quant table)
    exact = x.double() @ spec.dequantize(raw).double().T
    assert float((y.double() - exact).norm() / exact.norm()) <= 3e-2


@pytest.mark.skipif(not prompt.available(), reason="this CPU has no AVX512-VNNI: only the portable tiles run")
@pytest.mark.parametrize("shape", SHAPES)
def test_the_vnni_tiles_give_the_portable_bits(shape, monkeypatch):
    spec, raw, x = _case(shape)
    for xx in (x, x.bfloat16()):
        assert torch.equal(run(spec, raw, xx, "best", monkeypatch), run(spec, raw, xx, "portable", monkeypatch))


def test_rows_do_not_depend_on_t_threads_or_the_output_stride(monkeypatch):
    spec = QuantSpec.ggml("Q4_K", 40, 512)
    raw = random_stored(spec, seed=3)
    x = torch.randn(21, 512, generator=torch.Generator().manual_seed(4))
    for path in tile_paths():
        whole = run(spec, raw, x, path, monkeypatch, threads=2)
        assert torch.equal(run(spec, raw, x, path, monkeypatch, threads=1), whole)
        for a, b in ((0, 1), (3, 11), (11, 21)):
            assert torch.equal(run(spec, raw, x[a:b].contiguous(), path, monkeypatch), whole[a:b])
        wide = torch.full((21, 100), 7.0)  # two projections into column slices of one output
        prompt.linears([(spec, raw, wide[:, :40]), (spec, raw, wide[:, 50:90])], x)
        assert torch.equal(wide[:, :40], whole) and torch.equal(wide[:, 50:90], whole)
        assert (wide[:, 40:50] == 7).all() and (wide[:, 90:] == 7).all()


def test_bad_arguments_are_named():
    spec = QuantSpec.ggml("Q4_K", 16, 256)
    raw = random_stored(spec, seed=1)
    x = torch.randn(4, 256)
    with pytest.raises(ValueError, match="Q5_K and Q6_K with in_features a multiple of 256"):
        prompt.linears([(QuantSpec.ggml("Q8_0", 16, 256), raw, torch.empty(4, 16))], x)
    with pytest.raises(ValueError, match="x has 256 columns"):
        prompt.linears([(QuantSpec.ggml("Q4_K", 16, 512), random_stored(QuantSpec.ggml("Q4_K", 16, 512)),
                         torch.empty(4, 16))], x)
    with pytest.raises(ValueError, match=r"out must be float32 \[4, 16\]"):
        prompt.linears([(spec, raw, torch.empty(4, 16, dtype=torch.bfloat16))], x)
    with pytest.raises(ValueError, match="x must be a contiguous"):
        prompt.linears([(spec, raw, torch.empty(4, 16))], x.t())
    with pytest.raises(ValueError, match="raw"):
        prompt.linears([(spec, raw[:-1], torch.empty(4, 16))], x)
    with pytest.raises(ValueError, match="1 to 4 projections"):
        prompt.linears([], x)
    assert prompt.supported(spec) and not prompt.supported(QuantSpec.ggml("Q6_K", 16, 256))


# ---- in a model ----

LONG = torch.randint(0, 300, (160,), generator=torch.Generator().manual_seed(12)).tolist()


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    model = hf_model("qwen3_moe", **{**GGUF_TINY["qwen3_moe"], **K_SHAPES})
    return convert(model, tmp_path_factory.mktemp("q4km") / "m.gguf", qtype=q4_k_m)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts prompt.linears calls; where the CPU lacks AVX512-VNNI the model takes the kernel's portable path, and
    one with AMX (whose prompts take the bf16 GEMM route, quant/compute.py prompt_planes) is seen as one without."""
    calls = []
    monkeypatch.setattr(prompt, "available", lambda: True)
    monkeypatch.setattr("sluice.engine.amx_bf16", lambda: False)
    for name in ("linears", "expert"):
        monkeypatch.setattr(prompt, name,
                            lambda *a, _real=getattr(prompt, name), **kw: calls.append(1) or _real(*a, **kw))
    run = prompt.ExpertsCall.run
    monkeypatch.setattr(prompt.ExpertsCall, "run", lambda *a, **kw: calls.append(1) or run(*a, **kw))
    return calls


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_a_prompt_takes_the_kernel_near_the_float32_logits(q4km, kernel_calls):
    with sluice.load(q4km, memory="all", dtype="float32") as m:
        exact = m.logits(LONG)
    got = {}
    for act in ("int16", "int8"):
        with sluice.load(q4km, memory="all", activations=act) as m:
            kernel_calls.clear()
            got[act] = m.logits(LONG)
            # int16 takes the tiles too where the prompt's GEMMs are float32 (test_prompt_avx2.py)
            assert bool(kernel_calls) == (act == "int8" or not m.compute.bf16_gemm)
    assert not torch.equal(got["int8"], got["int16"])
    # the int16 prompt runs bf16 GEMMs (x to ~1/256 of itself; or the int16 tiles, x to ~1/32,000), int8 codes x
    # to 1/127 of each 256-block's max, and this random model amplifies small errors: int8 3.8e-2 with bf16 GEMMs
    # beside its tiles, 9.3e-2 with float32 ones (int16 there: 6.3e-2 and 1.5e-2)
    assert _rel(got["int8"], exact) <= max(5e-2 if m.compute.bf16_gemm else 0.12, 3 * _rel(got["int16"], exact))


@pytest.mark.parametrize("io", ["direct", "mmap"])
def test_a_streamed_int8_prompt_is_the_resident_bits(q4km, kernel_calls, io):
    assert_streamed_equals_resident(q4km, LONG, io, False, "min", activations="int8")
    assert kernel_calls


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("t", [1, 9, 40])
def test_one_expert_call_is_the_projections_in_turn(fused, t, monkeypatch):
    """prompt.expert = gate / up on x, silu(g) * u (its polynomial exp: within 2 ulp of torch's), down on that:
    the same as prompt.linears step by step up to the exp's last bits (a code of the product may flip), the same
    bits on both paths; with no down it hands back the product in bf16."""
    h, i = 512, 256
    gate, up, down = QuantSpec.ggml("Q4_K", i, h), QuantSpec.ggml("Q4_K", i, h), QuantSpec.ggml("Q4_K", h, i)
    raws = [random_stored(s, seed=n) for n, s in enumerate((gate, up, down))]
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).bfloat16()
    gu = torch.empty(t, 2 * i)
    prompt.linears([(gate, raws[0], gu[:, :i]), (up, raws[1], gu[:, i:])], x)
    prod = F.silu(gu[:, :i]) * gu[:, i:]
    want = torch.empty(t, h)
    prompt.linears([(down, raws[2], want)], prod)
    if fused:  # [gate; up] stored as one [2I, H] matrix
        args = ((QuantSpec.ggml("Q4_K", 2 * i, h), torch.cat(raws[:2])), None)
    else:
        args = ((gate, raws[0]), (up, raws[1]))
    def both(path):
        y, hh = torch.empty(t, h, dtype=torch.bfloat16), torch.empty(t, i, dtype=torch.bfloat16)
        prompt.expert(*args, (down, raws[2]), x, y, path=path)
        prompt.expert(*args, None, x, hh, path=path)
        return [y, hh]

    # every path: VNNI tiles where the CPU has them, the bf16 outputs rounded by AVX512_BF16, AVX2 or portable code
    outs = paths.on_each(both)
    for y, hh in outs:
        assert float((y.double() - want.double()).norm() / want.double().norm()) <= 5e-3
        ulp = (prod.abs().bfloat16().float() * 2.0**-7).clamp(min=1e-30)  # one bf16 step
        assert ((hh.float() - prod).abs() <= ulp).all()
    paths.same_bits(outs)


def test_int8_prompt_rows_are_not_padded(q4km, kernel_calls, monkeypatch):
    """A GEMM's rows are padded to experts.GEMM_ROW_STEP (oneDNN builds kernels per row count); the int8 kernels take
    any count at one speed, so their experts get their own rows only."""
    with sluice.load(q4km, memory="all", activations="int8") as m:
        seen: list[int] = []
        call, coded, many = GluMath.__call__, GluMath.coded, GluMath.coded_many
        monkeypatch.setattr(GluMath, "__call__", lambda self, b, j, x: (seen.append(x.shape[0]), call(self, b, j, x))[1])
        monkeypatch.setattr(GluMath, "coded",
                            lambda self, b, j, c, rows, out: (seen.append(rows.numel()), coded(self, b, j, c, rows, out))[1])
        monkeypatch.setattr(GluMath, "coded_many", lambda self, b, js, c, rows, starts, counts, out:
                            (seen.extend(counts), many(self, b, js, c, rows, starts, counts, out))[1])
        m.logits(LONG)
    assert kernel_calls and sum(seen) == len(LONG) * m.spec.top_k * m.spec.n_layers and any(n % 16 for n in seen)


def test_a_nan_in_x_gives_nan_rows_on_both_paths(monkeypatch):
    """A NaN in a 256-value block of x makes that row's outputs NaN (as a float GEMM's would), wherever it sits in
    the block and on both paths; the other rows keep their values."""
    spec = QuantSpec.ggml("Q4_K", 32, 512)
    raw = random_stored(spec, seed=5)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(6))
    clean = run(spec, raw, x, "best", monkeypatch)
    for at in (0, 17, 255, 300):
        bad = x.clone()
        bad[1, at] = float("nan")
        for y in (run(spec, raw, bad, path, monkeypatch) for path in tile_paths()):
            assert y[1].isnan().all()
            assert torch.equal(y[[0, 2, 3]], clean[[0, 2, 3]])


def test_float16_keeps_its_own_path(q4km, kernel_calls):
    """The int8 prompt kernels take bf16 rows; at --dtype float16 a prompt runs the float16 path it ran before (it
    once reached prompt.linears with float16 rows and raised). This random model overflows float16 (its logits are
    NaN at int16 too), so only the path is checked."""
    with sluice.load(q4km, memory="all", activations="int8", dtype="float16") as m:
        got = m.logits(LONG)
    assert not kernel_calls and got.shape == (len(LONG), m.spec.vocab_size)


def test_a_layer_coded_once_gives_each_expert_its_own_bits(q4km, kernel_calls):
    """A MoE layer codes its rows once (prompt.code) and each int8 expert gathers its rows' codes:
    the same bits as every expert coding its own rows (prompt.expert on a Coded x with rows == on those rows)."""
    h, i = 512, 256
    gate, up, down = QuantSpec.ggml("Q4_K", i, h), QuantSpec.ggml("Q4_K", i, h), QuantSpec.ggml("Q4_K", h, i)
    raws = [random_stored(s, seed=n) for n, s in enumerate((gate, up, down))]
    x = torch.randn(40, h, generator=torch.Generator().manual_seed(9)).bfloat16()
    rows = torch.tensor([3, 7, 7, 0, 39, 12, 5, 22, 30, 1])
    a, b = (torch.empty(10, h, dtype=torch.bfloat16) for _ in range(2))
    prompt.expert((gate, raws[0]), (up, raws[1]), (down, raws[2]), prompt.code(x), a, rows=rows)
    prompt.expert((gate, raws[0]), (up, raws[1]), (down, raws[2]), x[rows].contiguous(), b)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="rows must be a contiguous CPU int64"):
        prompt.expert((gate, raws[0]), (up, raws[1]), (down, raws[2]), prompt.code(x), a, rows=rows.int())
    with sluice.load(q4km, memory="all", activations="int8") as m:
        once = m.logits(LONG)
        m.model = m.model.rebuilt(Kernels(code_rows_once=False))
        assert torch.equal(m.logits(LONG), once)


def test_isa_caps_the_kernels_of_one_model(q4km, kernel_calls):
    """LoadOptions.isa "avx2": float32 GEMMs under matmul auto, the prompt's Q4_K rows on the AVX2 tiles (not the
    AVX512-VNNI ones), the C kernels capped at AVX2 (Compute.path); "portable" the plain C loops, the same bits."""
    with sluice.load(q4km, memory="all", activations="int8", isa="avx2") as m:
        kernel_calls.clear()
        capped = m.logits(LONG)
        assert kernel_calls and m.compute.path == native.AVX2 and not m.compute.bf16_gemm
        assert m.stats()["isa"] == "avx2" and m.stats()["matmul"] == "float32"
    with sluice.load(q4km, memory="all", activations="int8", isa="portable") as m:
        assert m.compute.path == native.PORTABLE and torch.equal(m.logits(LONG), capped)
