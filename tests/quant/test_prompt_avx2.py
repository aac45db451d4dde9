"""A prompt's Q4_K and Q6_K projections on AVX2 integer tiles (sluice/quant/native/prompt_avx2.c, prompt_q6k.c) at
both activation codings:
int16 (two planes of 8-bit codes, x ~ D * (hi + lo / 256), the default) and int8 (one plane, llama.cpp's Q8_K).

The kernel against its definition (the coded x times the exact Q4_K weights, float64); the AVX2 tiles give the
portable tiles' bits, for any T, thread count and output stride; a whole expert and a layer's rows coded once give
the same bits as the projections in turn; in a model (a tiny Q4_K_M GGUF) a prompt on a CPU whose GEMMs are float32
(here: --isa avx2) takes the tiles, its logits stay near the float32 run's and near transformers', and a streamed run
gives the resident run's bits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sluice
from sluice.quant import native
from sluice.quant.compute import Compute
from sluice.quant.native import pool, prompt
from sluice.quant.spec import QuantSpec
from tests.checkpoint.gguf_files import GGUF_TINY, convert
from tests.models.tiny import hf_model
from tests.quant import paths
from tests.quant.samples import random_stored
from tests.quant.streaming import assert_streamed_equals_resident
from tests.quant.test_gguf_models import K_SHAPES, q4_k_m

pytestmark = pytest.mark.skipif(not native.native_available(),
                                reason="native kernels not built (pip install -e . with a C compiler builds them)")

TILES = ["avx2", "portable"]  # the AVX2 tiles and their portable twin (an AVX-512 CPU runs the AVX2 ones too)


def coded(x: torch.Tensor, planes: int) -> torch.Tensor:
    """x [T, K] as the kernel codes it, decoded: D * (hi + lo / 256) per 256-value block (float32 steps as
    prompt.c takes them: r = x * (127 / amax) clamped, hi = rint(r), lo = rint((r - hi) * 256) clamped to 127)."""
    t, k = x.shape
    xb = x.float().view(t, k // 256, 256)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    r = (xb * inv).clamp(-127, 127)
    hi = r.round()
    code = hi.double()
    if planes == 2:
        code = code + ((r - hi) * 256).round().clamp(max=127).double() / 256
    return (code * (amax / 127.0).double()).view(t, k)


def run(spec, raw, x, path: str, planes: int, threads: int = 2) -> torch.Tensor:
    """prompt.linears on path ("avx2" or "portable"; skips where this CPU does not run it) with `threads`."""
    code = paths.code(path)
    old = pool.threads()
    pool.set_threads(threads)
    try:
        y = torch.empty(x.shape[0], spec.out_features)
        prompt.linears([(spec, raw, y)], x, planes=planes, path=code)
    finally:
        pool.set_threads(old)
    return y


SHAPES = [(37, 768, 17), (64, 1024, 8), (48, 512, 3), (16, 256, 1), (300, 512, 9), (40, 256, 33)]


def _case(shape, fmt: str = "Q4_K"):
    n, k, t = shape
    spec = QuantSpec.ggml(fmt, n, k)
    g = torch.Generator().manual_seed(k + t)  # the channels' spread too: the global generator made the bound flaky
    x = torch.randn(t, k, generator=g) * torch.rand(k, generator=g) * 4  # uneven channels
    return spec, random_stored(spec, seed=n), x


@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_tiles_are_their_definition_and_give_the_portable_bits(shape, planes, fmt):
    spec, raw, x = _case(shape, fmt)
    w = spec.dequantize(raw).double()
    outs = []
    for xx in (x, x.bfloat16()):
        ys = [run(spec, raw, xx, path, planes) for path in TILES if path == "portable" or native.simd()]
        ref = coded(xx.float(), planes) @ w.T
        for y in ys:
            assert float((y.double() - ref).norm() / ref.norm()) <= 1e-6
        outs.append(ys)
    exact = x.double() @ w.T
    # against the exact product: two planes ~3e-5 (finer than bf16), one ~1e-2 (llama.cpp's Q8_K)
    assert float((outs[0][0].double() - exact).norm() / exact.norm()) <= (1e-4 if planes == 2 else 3e-2)
    paths.same_bits([list(c) for c in zip(*outs)])  # [[avx2 float32 x, avx2 bf16 x], [portable ...]]


@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K"])
def test_rows_do_not_depend_on_t_threads_or_the_output_stride(fmt):
    spec = QuantSpec.ggml(fmt, 40, 512)
    raw = random_stored(spec, seed=3)
    x = torch.randn(21, 512, generator=torch.Generator().manual_seed(4))
    for path in TILES:
        for planes in (1, 2):
            whole = run(spec, raw, x, path, planes, threads=2)
            assert torch.equal(run(spec, raw, x, path, planes, threads=1), whole)
            for a, b in ((0, 1), (3, 11), (11, 21), (0, 9)):
                assert torch.equal(run(spec, raw, x[a:b].contiguous(), path, planes), whole[a:b])
            wide = torch.full((21, 100), 7.0)  # two projections into column slices of one output
            prompt.linears([(spec, raw, wide[:, :40]), (spec, raw, wide[:, 50:90])], x, planes=planes,
                           path=paths.code(path))
            assert torch.equal(wide[:, :40], whole) and torch.equal(wide[:, 50:90], whole)
            assert (wide[:, 40:50] == 7).all() and (wide[:, 90:] == 7).all()


@pytest.mark.parametrize("planes", [1, 2])
def test_the_coding_is_the_same_bytes_on_every_path(planes):
    """prompt.code on AVX2 intrinsics (prompt.c quant_row_avx2) against the portable loop: the same codes, scales
    and sums byte for byte, on ordinary rows and on rows with zeros, infinities, NaNs, subnormals, ties at .5 and
    values at the clamp."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(9, 768, generator=g) * torch.logspace(-3, 3, 9).unsqueeze(1)
    x[1] = 0.0
    x[2, 5] = float("inf")
    x[3, 300] = float("-inf")
    x[4, 513] = float("nan")
    x[5] = torch.full((768,), 1e-40)
    x[6, :256] = torch.arange(256) - 127.5  # ties after the scale
    x[7, ::7] = -x[7].abs().max()
    x[8, 256:512] = -0.0
    xb = x.bfloat16()
    used = planes * (9 * 768 + 9 * 24 * 2) + 9 * 3 * 4  # codes, sums (each plane), scales; then padding to 64
    outs = paths.on_each(lambda path: prompt.code(xb, planes=planes, path=path).data[:used])
    paths.same_bits(outs)


def test_the_bf16_rounding_is_torchs_on_every_path():
    """prompt.to_bf16 (a projection's float32 rows to bf16 over the pool) gives torch's .to(torch.bfloat16) bit for
    bit: ties to even, infinities, subnormals, values that round to inf, rows of a column slice; a NaN stays a NaN
    (0x7fc0 on every path; torch's vectorized conversion writes 0xffff, its scalar one 0x7fc0)."""
    g = torch.Generator().manual_seed(12)
    y = torch.randn(37, 300, generator=g) * torch.logspace(-30, 30, 300)
    y[0, :8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-42, -1e-40, 3.4e38, -0.0, 0.0])
    y[1, :4] = torch.tensor([1.00390625, 1.01171875, -1.00390625, 2.0 ** 120 * 1.00390625])  # halfway: to even
    y[2] = torch.finfo(torch.float32).max
    wide = torch.randn(37, 320, generator=g)
    wide[:, 7:307] = y
    for src in (y, wide[:, 7:307]):
        nan = src.isnan()
        ref = src.to(torch.bfloat16).view(torch.int16)
        outs = paths.on_each(lambda path: prompt.to_bf16(src, path=path).view(torch.int16))
        for out in outs:
            assert torch.equal(out[~nan], ref[~nan]) and (out[nan] == 0x7FC0).all()
    with pytest.raises(ValueError, match="float32"):
        prompt.to_bf16(y.double())


def test_a_nan_in_x_gives_nan_rows():
    spec = QuantSpec.ggml("Q4_K", 32, 512)
    raw = random_stored(spec, seed=5)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(6))
    for path in TILES:
        clean = run(spec, raw, x, path, 2)
        for at in (0, 17, 255, 300):
            bad = x.clone()
            bad[1, at] = float("nan")
            y = run(spec, raw, bad, path, 2)
            assert y[1].isnan().all() and torch.equal(y[[0, 2, 3]], clean[[0, 2, 3]])


@pytest.mark.parametrize("fused", [False, True])
def test_many_experts_in_one_call_are_each_ones_bits(fused):
    """prompt.ExpertsCall (a pass's experts in one native call, slots of gate | up | down bytes) gives each expert
    the bits prompt.expert gives it on its own rows, on every path; bad slots and shapes are named."""
    h, i, planes = 512, 256, 2
    gate, up, down = QuantSpec.ggml("Q4_K", i, h), QuantSpec.ggml("Q4_K", i, h), QuantSpec.ggml("Q6_K", h, i)
    gu = QuantSpec.ggml("Q4_K", 2 * i, h)
    offsets = (0, gate.nbytes, gate.nbytes + up.nbytes)
    slots = torch.stack([torch.cat([random_stored(s, seed=10 * e + n) for n, s in enumerate((gate, up, down))])
                         for e in range(4)])  # [4 slots, bytes]
    x = torch.randn(50, h, generator=torch.Generator().manual_seed(8)).bfloat16()
    rows = torch.randint(0, 50, (61,), generator=torch.Generator().manual_seed(9))
    use, starts, counts = [3, 0, 2], [0, 30, 37], [30, 7, 24]  # slot 1 unused

    def each(path):
        coded = prompt.code(x, planes=planes, path=path)
        out = torch.zeros(61, h, dtype=torch.bfloat16)
        call = prompt.ExpertsCall(gu if fused else gate, None if fused else up, down, offsets)
        call.run(slots, use, coded, rows, starts, counts, out, path=path)
        want = torch.zeros(61, h, dtype=torch.bfloat16)
        for sl, a, n in zip(use, starts, counts):
            raw = slots[sl]
            g = (gu, raw[: 2 * gate.nbytes]) if fused else (gate, raw[: gate.nbytes])
            u = None if fused else (up, raw[offsets[1] : offsets[2]])
            prompt.expert(g, u, (down, raw[offsets[2] : offsets[2] + down.nbytes]), coded, want[a : a + n],
                          rows=rows[a : a + n].contiguous(), planes=planes, path=path)
        assert torch.equal(out, want) and out.abs().sum() > 0
        return out

    paths.same_bits(paths.on_each(each))
    call = prompt.ExpertsCall(gate, up, down, offsets)
    coded, out = prompt.code(x, planes=planes), torch.zeros(61, h, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="slots"):
        call.run(slots, [4], coded, rows, [0], [5], out)
    with pytest.raises(ValueError, match="refused"):
        call.run(slots, [0], coded, rows, [60], [5], out)  # past the rows
    with pytest.raises(ValueError, match="down must be"):
        prompt.ExpertsCall(gate, up, QuantSpec.ggml("Q8_0", h, i), offsets)


@pytest.mark.parametrize("fmts", [("Q4_K", "Q4_K"), ("Q4_K", "Q6_K"), ("Q5_K", "Q6_K")])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("t", [1, 9, 40])
def test_one_expert_call_is_the_projections_in_turn(fused, t, fmts):
    """prompt.expert at two planes = gate / up (Q4_K or Q5_K), silu(g) * u (exp_poly), down (Q4_K or Q6_K, as a
    Q4_K_M file's layers alternate) on the product coded again: near the step-by-step result (a code of the product may flip with
    exp's last bits), the same bits on both tile paths; a layer's rows coded once (prompt.code) give each expert the
    bits of its own rows."""
    h, i = 512, 256
    gate, up, down = QuantSpec.ggml(fmts[0], i, h), QuantSpec.ggml(fmts[0], i, h), QuantSpec.ggml(fmts[1], h, i)
    raws = [random_stored(s, seed=n) for n, s in enumerate((gate, up, down))]
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).bfloat16()
    gu = torch.empty(t, 2 * i)
    prompt.linears([(gate, raws[0], gu[:, :i]), (up, raws[1], gu[:, i:])], x, planes=2)
    prod = F.silu(gu[:, :i]) * gu[:, i:]
    want = torch.empty(t, h)
    prompt.linears([(down, raws[2], want)], prod, planes=2)
    args = (((QuantSpec.ggml(fmts[0], 2 * i, h), torch.cat(raws[:2])), None) if fused
            else ((gate, raws[0]), (up, raws[1])))

    def both(path):
        y, hh = torch.empty(t, h, dtype=torch.bfloat16), torch.empty(t, i, dtype=torch.bfloat16)
        prompt.expert(*args, (down, raws[2]), x, y, planes=2, path=path)
        prompt.expert(*args, None, x, hh, planes=2, path=path)
        rows = torch.arange(t - 1, -1, -1)
        yc = torch.empty(t, h, dtype=torch.bfloat16)
        prompt.expert(*args, (down, raws[2]), prompt.code(x, planes=2, path=path), yc, rows=rows, path=path)
        assert torch.equal(yc, y.flip(0))
        return [y, hh]

    outs = paths.on_each(both, TILES)
    for y, hh in outs:
        assert float((y.double() - want.double()).norm() / want.double().norm()) <= 2e-3
        ulp = (prod.abs().bfloat16().float() * 2.0**-7).clamp(min=1e-30)  # one bf16 step
        assert ((hh.float() - prod).abs() <= ulp).all()
    paths.same_bits(outs)


def test_bad_arguments_are_named():
    spec = QuantSpec.ggml("Q4_K", 16, 256)
    q8, q6 = QuantSpec.ggml("Q8_0", 16, 256), QuantSpec.ggml("Q6_K", 16, 256)
    with pytest.raises(ValueError, match="computes Q4_K, Q5_K and Q6_K"):
        prompt.linears([(q8, random_stored(q8), torch.empty(2, 16))], torch.randn(2, 256), planes=2)
    x, h = torch.randn(2, 256).bfloat16(), torch.empty(2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gate must be Q4_K or Q5_K or Q6_K"):
        prompt.expert((q8, random_stored(q8)), (q8, random_stored(q8)), None, x, h, planes=2)
    with pytest.raises(ValueError, match="share a format"):
        prompt.expert((spec, random_stored(spec)), (q6, random_stored(q6)), None, x, h, planes=2)
    with pytest.raises(ValueError, match="planes must be 1"):
        prompt.linears([(spec, random_stored(spec), torch.empty(2, 16))], torch.randn(2, 256), planes=3)
    with pytest.raises(ValueError, match="planes must be 1"):
        prompt.code(torch.randn(2, 256).bfloat16(), planes=0)


def test_which_computes_take_the_tiles():
    """Compute.prompt_planes: the model's planes where a prompt's GEMMs are float32 (no bf16 dot products, or
    capped), any path cap (the portable one runs the same tiles in C); none at float32 / float16 compute, none where
    bf16 GEMMs run (but int8 on a VNNI CPU, prompt.c's VNNI tiles)."""
    if not prompt.avx2():
        pytest.skip(paths.NO_AVX2)
    for path in (paths.BEST, paths.AVX2, paths.PORTABLE):
        for planes in (1, 2):
            c = Compute(bf16_gemm=False, planes=planes, path=path)
            assert c.prompt_planes == planes
            assert Compute(dtype=torch.float32, bf16_gemm=False, planes=planes, path=path).prompt_planes == 0
    assert Compute(bf16_gemm=True, planes=2).prompt_planes == 0
    assert Compute(bf16_gemm=True, planes=1).prompt_planes == (1 if prompt.available() else 0)
    # AMX: the bf16 GEMM route and torch's attention (Compute.amx; engine.py sets it from /proc/cpuinfo)
    amx = Compute(bf16_gemm=True, planes=1, amx=True)
    assert (amx.prompt_planes, amx.prompt_formats, amx.attend_prompt) == (0, frozenset(), False)
    assert Compute(bf16_gemm=False, planes=1, path=paths.AVX2, amx=True).prompt_planes == 1  # capped: AVX2 tiles
    # a prompt's SDPA: widened to float32 on bf16 products under bf16 GEMMs, on its bf16 inputs on AMX from
    # AMX_SDPA_MIN_ROWS rows; float32 GEMMs (AVX2, or capped) never widen
    from sluice.quant.compute import AMX_SDPA_MIN_ROWS

    rows = AMX_SDPA_MIN_ROWS
    assert amx.sdpa_widen(rows - 1) and not amx.sdpa_widen(rows) and not amx.sdpa_widen(4 * rows)
    assert Compute(bf16_gemm=True, amx=False).sdpa_widen(4 * rows)
    assert not Compute(bf16_gemm=False, amx=False).sdpa_widen(1) and not Compute(bf16_gemm=False).sdpa_widen(rows)


def test_the_loaded_model_knows_its_amx(tmp_path):
    """A model's Compute.amx is the CPU's amx_bf16 flag, off when the kernels are capped (--isa avx2)."""
    import sluice
    from sluice.host.cpus import amx_bf16
    from tests.models.tiny import hf_model, write_checkpoint

    folder = write_checkpoint(hf_model("qwen3_moe", torch.bfloat16), tmp_path, "per_expert")
    with sluice.load(folder) as m:
        assert m.compute.amx == amx_bf16()
    with sluice.load(folder, isa="avx2") as m:
        assert m.compute.amx is False
    flags = tmp_path / "cpuinfo"
    flags.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16 amx_tile amx_bf16\n")
    assert amx_bf16(flags) and not amx_bf16(tmp_path / "missing")
    flags.write_text("flags\t\t: fpu avx2 avx512_bf16\n")
    assert not amx_bf16(flags)


def test_a_layers_q_k_v_in_one_call_are_each_ones_bits():
    """QuantGroup.prompt_rows (attention's q / k / v of a prompt: x coded once, one pool run) gives each
    QuantLinear.linear's bits, biases added as it adds them; too few rows or a format off the tiles: None."""
    if not prompt.avx2():
        pytest.skip(paths.NO_AVX2)
    from sluice.quant.linear import QuantLinear

    c = Compute(bf16_gemm=False, planes=1, path=paths.AVX2)  # int8: a lone Q6_K takes the tiles too (int16: not)
    ws = [QuantLinear(s, random_stored(s, seed=n), c)
          for n, s in enumerate((QuantSpec.ggml("Q4_K", 512, 512), QuantSpec.ggml("Q4_K", 128, 512),
                                 QuantSpec.ggml("Q6_K", 128, 512)))]
    assert QuantLinear(ws[2].spec, ws[2].raw, Compute(bf16_gemm=False, planes=2)).prompt_planes == 0
    group = QuantLinear.group(ws)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(2)).bfloat16()
    biases = (None, torch.randn(128).bfloat16(), None)
    got = group.prompt_rows(x, biases)
    for w, b, y in zip(ws, biases, got):
        assert torch.equal(y, w.linear(x, b))
    assert group.prompt_rows(x[:8], biases) is None
    q8 = QuantSpec.ggml("Q8_0", 128, 512)
    assert QuantLinear.group([*ws[:2], QuantLinear(q8, random_stored(q8), c)]).prompt_rows(x, biases) is None


# ---- in a model ----

LONG = torch.randint(0, 300, (160,), generator=torch.Generator().manual_seed(12)).tolist()


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    model = hf_model("qwen3_moe", **{**GGUF_TINY["qwen3_moe"], **K_SHAPES})
    return convert(model, tmp_path_factory.mktemp("q4km") / "m.gguf", qtype=q4_k_m), model


@pytest.fixture
def tile_calls(monkeypatch):
    """The planes of every prompt.linears / prompt.expert / prompt.ExpertsCall call."""
    calls = []
    for name in ("linears", "expert"):
        monkeypatch.setattr(prompt, name, lambda *a, _real=getattr(prompt, name), **kw:
                            calls.append(kw.get("planes")) or _real(*a, **kw))
    run = prompt.ExpertsCall.run
    monkeypatch.setattr(prompt.ExpertsCall, "run", lambda self, raw, slots, x, *a, **kw:
                        calls.append(x.planes) or run(self, raw, slots, x, *a, **kw))
    return calls


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_a_capped_prompt_takes_the_tiles_near_the_float32_and_transformers_logits(q4km, tile_calls):
    if not prompt.avx2():
        pytest.skip(paths.NO_AVX2)
    path, hf = q4km
    with sluice.load(path, memory="all", dtype="float32") as m:
        exact = m.logits(LONG)
    with torch.no_grad():
        ref = hf(torch.tensor([LONG])).logits[0].float()
    got = {}
    for act, planes in (("int16", 2), ("int8", 1)):
        with sluice.load(path, memory="all", activations=act, isa="avx2") as m:
            tile_calls.clear()
            got[act] = m.logits(LONG)
            assert m.compute.prompt_planes == planes and tile_calls and set(tile_calls) == {planes}
        with sluice.load(path, memory="all", activations=act, isa="portable") as m:
            assert torch.equal(m.logits(LONG), got[act])  # the portable tiles: the same bits
    # int16 codes x to ~1/32,000 of each block's max, int8 to 1/127 (llama.cpp's Q8_K), and this random model
    # amplifies small errors: measured 1.6e-2 and 9.3e-2 (a default load on an AVX512_BF16 CPU, bf16 GEMMs: 6.3e-2;
    # int8 there, prompt.c's VNNI tiles with bf16 GEMMs beside them: 3.8e-2)
    assert _rel(got["int16"], exact) <= 3e-2
    assert _rel(got["int8"], exact) <= 0.12
    # transformers on the float weights: the Q4_K_M quantization's own error plus the above
    assert _rel(got["int16"], ref) <= 1.5 * _rel(exact, ref) + 3e-2


@pytest.mark.parametrize("io", ["direct", "mmap"])
def test_a_streamed_capped_prompt_is_the_resident_bits(q4km, tile_calls, io):
    if not prompt.avx2():
        pytest.skip(paths.NO_AVX2)
    assert_streamed_equals_resident(q4km[0], LONG, io, False, "min", isa="avx2")
    assert tile_calls and set(tile_calls) == {1}  # a Q4_K_M file's default: int8 (auto, under 5.5 bits a weight)
