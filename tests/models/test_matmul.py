"""How several bf16 rows multiply bf16 weights (sluice/quant/matmul.py rows_linear, LoadOptions.matmul): "bf16" is
torch's bf16 GEMM, "float32" widens both sides, "auto" follows the CPU's flags (host/cpus.bf16_dot); one row stays
in the compute dtype either way. The choice is each model's (Compute.bf16_gemm), made at its load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.host.cpus import bf16_dot
from sluice.quant import matmul
from sluice.quant.matmul import resolve_matmul, rows_linear


def _xw(rows: int):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).bfloat16()
    w = torch.randn(80, 96, generator=g).bfloat16()
    b = torch.randn(80, generator=g).bfloat16()
    return x, w, b


def test_each_mode_runs_its_own_gemm():
    x, w, b = _xw(17)
    assert resolve_matmul("bf16") is True and resolve_matmul("float32") is False
    assert torch.equal(rows_linear(x, w, b, bf16=True), F.linear(x, w, b))
    want = F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16)
    assert torch.equal(rows_linear(x, w, b, bf16=False), want)
    assert rows_linear(x, w, b).dtype is torch.bfloat16


def test_the_modes_agree_to_bf16_rounding():
    x, w, _ = _xw(64)
    a = rows_linear(x, w, bf16=True).float()
    f = rows_linear(x, w, bf16=False).float()
    ref = F.linear(x.double(), w.double())
    for y in (a, f):  # both accumulate in float32 and round once: within bf16's half-ulp of the exact products
        assert ((y.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-6).all()


@pytest.mark.parametrize("mode", ["bf16", "float32"])
def test_one_row_and_float16_keep_their_paths(mode):
    bf16 = resolve_matmul(mode)
    x, w, b = _xw(1)
    assert torch.equal(rows_linear(x, w, b, bf16), F.linear(x, w, b))  # decode: the compute dtype
    x, w, b = (t.half() for t in _xw(9))
    assert torch.equal(rows_linear(x, w, b, bf16), F.linear(x.float(), w.float(), b.float()).half())  # f16: float32


def test_auto_follows_the_cpu_unless_the_isa_is_capped():
    assert resolve_matmul("auto") is bf16_dot()
    assert resolve_matmul("auto", avx2=True) is False and resolve_matmul("bf16", avx2=True) is True
    with pytest.raises(ValueError, match="matmul mode 'fast'"):
        resolve_matmul("fast")


def test_inspect_and_stats_say_which_gemm_a_prompt_runs(tmp_path, capsys, monkeypatch):
    import sluice
    from sluice import cli
    from tests.models.tiny import hf_model, write_checkpoint

    folder = write_checkpoint(hf_model("qwen3_moe", torch.bfloat16), tmp_path / "m", "per_expert")
    monkeypatch.setattr("sluice.quant.matmul.bf16_dot", lambda: False)
    assert cli.main(["inspect", str(folder), "--usage-tokens", "0"]) == 0
    assert "bf16 rows: float32 GEMM (auto: this CPU has no bf16 dot-product instructions)" in capsys.readouterr().out
    assert cli.main(["inspect", str(folder), "--usage-tokens", "0", "--matmul", "bf16"]) == 0
    assert "bf16 rows: bf16 GEMM (--matmul bf16)" in capsys.readouterr().out
    for mode, want in (("auto", "float32"), ("bf16", "bf16"), ("float32", "float32")):
        with sluice.load(folder, memory="all", matmul=mode) as m:
            assert m.stats()["matmul"] == want


def _packable_here() -> bool:
    return matmul.packable(80, 96)


@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 64, 200])
def test_packed_weights_give_f_linears_bits(rows):
    """A resident store keeps bf16 experts packed (matmul.pack) where this holds, and a streaming store runs F.linear
    on its slots: the two must agree bitwise for any row count."""
    if not _packable_here():
        pytest.skip("torch has no oneDNN bf16 GEMM on this CPU: stores keep plain weights")
    x, w, _ = _xw(rows)
    p = matmul.pack(w)
    assert p.is_mkldnn and tuple(p.shape) == tuple(w.shape)
    assert torch.equal(matmul.packed_linear(x, p), F.linear(x, w))
    assert torch.equal(matmul.packed_linear(x[:, :].t().contiguous().t(), p), F.linear(x, w))  # strided rows too


def test_two_models_in_one_process_keep_their_own_settings(tmp_path):
    """matmul, activations, isa and threads are each model's (quant/compute.py): loading a second model with other
    options changes nothing in the first, whose logits stay its own; each model runs on its own threads."""
    import sluice
    from sluice.quant.native import pool
    from tests.models.tiny import hf_model, write_checkpoint

    folder = write_checkpoint(hf_model("qwen3_moe", torch.bfloat16), tmp_path / "m", "per_expert")
    ids = list(range(3, 40))
    threads = torch.get_num_threads()
    try:
        with sluice.load(folder, memory="all", matmul="bf16", threads=2) as a:
            first = a.logits(ids)
            with sluice.load(folder, memory="all", matmul="float32", isa="portable", threads=1) as b:
                assert (a.compute.bf16_gemm, b.compute.bf16_gemm) == (True, False)
                assert a.compute.path != b.compute.path
                other = b.logits(ids)
                assert (torch.get_num_threads(), pool.threads()) == (1, 1)
                assert torch.equal(a.logits(ids), first)  # still bf16 GEMMs, on its own two threads
                assert (torch.get_num_threads(), pool.threads()) == (2, 2)
                assert a.stats()["matmul"] == "bf16" and b.stats()["matmul"] == "float32"
            assert not torch.equal(other, first)  # the float32 GEMMs are another computation
    finally:
        torch.set_num_threads(threads)
        pool.set_threads(1)


def test_a_streamed_and_a_resident_model_each_run_with_their_own_pool_wait(tmp_path):
    """The C pool's wait between jobs (native/pool.py set_wait) is the process's, like its thread count: a model
    that streams its experts applies the short one when it runs, a resident model the long one, in one process."""
    import sluice
    from sluice.quant import native
    from sluice.quant.native import pool
    from tests.models.tiny import hf_model, write_checkpoint

    if not native.native_available():
        pytest.skip("the native kernels are not built: no C pool")
    folder = write_checkpoint(hf_model("qwen3_moe", torch.bfloat16), tmp_path / "m", "per_expert")
    ids = list(range(3, 12))
    try:
        with sluice.load(folder, memory="all") as resident, sluice.load(folder, memory="300KiB") as streamed:
            assert streamed.stats()["slots"] < streamed.spec.num_experts * streamed.spec.n_layers  # it streams
            streamed.logits(ids)
            assert pool.wait() == pool.WAIT_STREAMED_NS
            resident.logits(ids)
            assert pool.wait() == pool.WAIT_RESIDENT_NS
            streamed.logits(ids)
            assert pool.wait() == pool.WAIT_STREAMED_NS
    finally:
        pool.set_wait(pool.WAIT_RESIDENT_NS)


def _qkv(T: int, D: int = 24, scale: float = 4.0):
    g = torch.Generator().manual_seed(T)
    q = (scale * torch.randn(1, 4, T, D, generator=g)).bfloat16()
    k = (scale * torch.randn(1, 2, T, D, generator=g)).bfloat16()
    v = torch.randn(1, 2, T, D, generator=g).bfloat16()
    return q, k, v


@pytest.mark.parametrize("masked", [False, True])
def test_prompt_attention_has_float32_scores_under_bf16(masked):
    """matmul.sdpa under bf16 GEMMs: float32 attention on bf16 dot products, one rounding at the end; closer to a
    float64 reference than bf16 SDPA (which rounds on the way), and the process's float32 precision is left as it
    was."""
    T = 200
    q, k, v = _qkv(T)
    kw = dict(attn_mask=torch.ones(T, T, dtype=torch.bool).tril()) if masked else dict(is_causal=True)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True, **kw)
    before = torch.backends.mkldnn.matmul.fp32_precision
    got = matmul.sdpa(q, k, v, True, enable_gqa=True, **kw)
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    assert got.dtype is torch.bfloat16 and got.shape == q.shape
    plain = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    err = lambda y: ((y.double() - ref).norm() / ref.norm()).item()  # noqa: E731
    assert err(got) <= err(plain) and err(got) <= 2**-8


def test_prompt_attention_elsewhere_is_plain_sdpa():
    q, k, v = _qkv(40)
    assert torch.equal(matmul.sdpa(q, k, v, False, is_causal=True, enable_gqa=True),
                       F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    # on bf16 GEMMs, one query row (decode on the torch path) and other dtypes run SDPA as given
    one = q[:, :, -1:]
    assert torch.equal(matmul.sdpa(one, k, v, True, enable_gqa=True),
                       F.scaled_dot_product_attention(one, k, v, enable_gqa=True))
    qf, kf, vf = q.float(), k.float(), v.float()
    assert torch.equal(matmul.sdpa(qf, kf, vf, True, is_causal=True, enable_gqa=True),
                       F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=True))


def test_prompt_attention_restores_the_precision_on_errors():
    q, k, v = _qkv(8)
    before = torch.backends.mkldnn.matmul.fp32_precision
    with pytest.raises(RuntimeError):
        matmul.sdpa(q, k[..., :5], v, True, is_causal=True, enable_gqa=True)  # head dims that do not match
    assert torch.backends.mkldnn.matmul.fp32_precision == before
