"""How several bf16 rows multiply bf16 weights (sluice/matmul.py rows_linear, LoadOptions.matmul): "bf16" is
torch's bf16 GEMM, "float32" widens both sides, "auto" follows the CPU's flags (host/cpus.bf16_dot); one row stays
in the compute dtype either way. The choice is process-wide, set at each load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.host.cpus import bf16_dot
from sluice import matmul
from sluice.matmul import bf16_gemm, rows_linear, set_matmul


@pytest.fixture(autouse=True)
def _restore():
    yield
    set_matmul("auto")


def _xw(rows: int):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).bfloat16()
    w = torch.randn(80, 96, generator=g).bfloat16()
    b = torch.randn(80, generator=g).bfloat16()
    return x, w, b


def test_each_mode_runs_its_own_gemm():
    x, w, b = _xw(17)
    assert set_matmul("bf16") is True and bf16_gemm()
    assert torch.equal(rows_linear(x, w, b), F.linear(x, w, b))
    assert set_matmul("float32") is False and not bf16_gemm()
    want = F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16)
    assert torch.equal(rows_linear(x, w, b), want)
    assert rows_linear(x, w, b).dtype is torch.bfloat16


def test_the_modes_agree_to_bf16_rounding():
    x, w, _ = _xw(64)
    set_matmul("bf16")
    a = rows_linear(x, w).float()
    set_matmul("float32")
    f = rows_linear(x, w).float()
    ref = F.linear(x.double(), w.double())
    for y in (a, f):  # both accumulate in float32 and round once: within bf16's half-ulp of the exact products
        assert ((y.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-6).all()


@pytest.mark.parametrize("mode", ["bf16", "float32"])
def test_one_row_and_float16_keep_their_paths(mode):
    set_matmul(mode)
    x, w, b = _xw(1)
    assert torch.equal(rows_linear(x, w, b), F.linear(x, w, b))  # decode: the compute dtype
    x, w, b = (t.half() for t in _xw(9))
    assert torch.equal(rows_linear(x, w, b), F.linear(x.float(), w.float(), b.float()).half())  # f16: float32


def test_auto_follows_the_cpu():
    assert set_matmul("auto") is bf16_dot()
    matmul._bf16_gemm = None  # never set: the first use decides as auto does
    assert bf16_gemm() is bf16_dot()
    with pytest.raises(ValueError, match="matmul mode 'fast'"):
        set_matmul("fast")


def test_inspect_and_stats_say_which_gemm_a_prompt_runs(tmp_path, capsys, monkeypatch):
    import sluice
    from sluice import cli
    from tests.models.tiny import hf_model, write_checkpoint

    folder = write_checkpoint(hf_model("qwen3_moe", torch.bfloat16), tmp_path / "m", "per_expert")
    monkeypatch.setattr("sluice.matmul.bf16_dot", lambda: False)
    assert cli.main(["inspect", str(folder), "--usage-tokens", "0"]) == 0
    assert "bf16 rows: float32 GEMM (auto: this CPU has no bf16 dot-product instructions)" in capsys.readouterr().out
    assert cli.main(["inspect", str(folder), "--usage-tokens", "0", "--matmul", "bf16"]) == 0
    assert "bf16 rows: bf16 GEMM (--matmul bf16)" in capsys.readouterr().out
    for mode, want in (("auto", "float32"), ("bf16", "bf16"), ("float32", "float32")):
        with sluice.load(folder, memory="all", matmul=mode) as m:
            assert m.stats()["matmul"] == want
