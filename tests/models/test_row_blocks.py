"""A prompt's expert rows run in row blocks (matmul.row_blocks, models/layers/experts.py GluMath._swiglu): few GEMM
shapes whatever the prompt, and the [rows, 2I] gate / up output kept cache-sized. The blocks cover every row once,
the logits are those of unsplit rows (bitwise where this CPU's GEMM gives a row the same bits whatever the row
count, else within the GEMM's rounding), and streamed runs stay bitwise the resident ones, for bf16 and quantized
experts (a quantized expert's weights are dequantized to bf16 once for all its blocks)."""

from __future__ import annotations

import pytest
import torch

import sluice
from sluice.quant import matmul
from sluice.models.layers import experts
from tests.checkpoint.gguf_files import GGUF_TINY, Q, convert
from tests.models.tiny import hf_model, write_checkpoint
from tests.quant.mlx_files import mlx_folder

PROMPT = torch.randint(0, 300, (240,), generator=torch.Generator().manual_seed(11)).tolist()  # ~60 rows an expert
SHAPES = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256, head_dim=64)  # whole K blocks


@pytest.mark.parametrize("n", [0, 1, 15, 16, 256, 257, 272, 511, 512, 528, 1000, 2305, 3841, 4096, 4609])
@pytest.mark.parametrize("width", [64, 1024, 7296, 65536])
def test_row_blocks_cover_the_rows_in_few_even_blocks(n, width):
    most = max(matmul.GEMM_MIN_BLOCK, matmul.GEMM_BLOCK_BYTES // (2 * width) // 16 * 16)
    blocks = matmul.row_blocks(n, width)
    assert blocks[0][0] == 0 and blocks[-1][1] == n
    assert all(b[1] == c[0] for b, c in zip(blocks, blocks[1:]))  # contiguous, in order
    sizes = [b - a for a, b in blocks]
    assert max(sizes) <= max(most, n if len(blocks) == 1 else 0)
    assert len(blocks) == max(1, -(-n // most))  # as few as the limit allows
    assert all(s % 16 == 0 for s in sizes[:-1]) and (n % 16 or sizes[-1] % 16 == 0)
    full = sizes[:-1] if n % 16 and len(sizes) > 1 else sizes
    assert max(sizes) - min(full) <= 16 and max(sizes) - sizes[-1] < 32  # even: no small tail beside full blocks


def test_the_block_limit_follows_the_output_width():
    assert matmul.row_blocks(512, 7296) != [(0, 512)]  # the demo model's 2I: ~4 MiB of gate / up output
    assert matmul.row_blocks(2048, 1024) == [(0, 2048)]  # narrow experts: one GEMM


def _rows_independent(spec, rows: int, block: int) -> bool:
    """Whether this CPU's bf16 GEMM gives each `block` rows of `rows` the same bits alone as in the whole (a
    property of oneDNN's kernel choice per row count, so asked, not assumed), for the model's expert shapes."""
    g = torch.Generator().manual_seed(1)
    same = True
    for n_out, n_in in ((2 * spec.moe_intermediate_size, spec.hidden_size),
                        (spec.hidden_size, spec.moe_intermediate_size)):
        x = torch.randn(rows, n_in, generator=g).bfloat16()
        w = torch.randn(n_out, n_in, generator=g).bfloat16()
        whole = torch.nn.functional.linear(x, w)
        same &= all(torch.equal(torch.nn.functional.linear(x[a : a + block], w), whole[a : a + block])
                    for a in range(0, rows, block))
    return same


def _plain(name: str) -> bool:
    return name.endswith(("norm.weight", "ffn_gate_inp.weight", ".bias"))


@pytest.fixture(scope="module", params=["safetensors-bf16", "gguf-q4_k-q6_k", "mlx-4bit"])
def model(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "safetensors-bf16":
        return write_checkpoint(hf_model("qwen3_moe", torch.bfloat16, **SHAPES), root, "per_expert")
    if request.param == "mlx-4bit":  # gate and up stored apart: dequantized one after the other (_bf16_weights)
        return mlx_folder("qwen3_moe", root, 4, 64, "bfloat16", **SHAPES)[0]
    model = hf_model("qwen3_moe", **{**GGUF_TINY["qwen3_moe"], **SHAPES})
    qtype = lambda n: Q.F32 if _plain(n) else Q.Q6_K if "ffn_down" in n else Q.Q4_K  # noqa: E731
    return convert(model, root / "m.gguf", qtype=qtype)


def _run(path, monkeypatch, memory="all", **kw):
    """(logits of PROMPT, the row counts GluMath._swiglu's GEMMs were given, the model) under bf16 GEMMs (activations
    int16: a Q4_K file's default, int8, runs a prompt's experts on prompt.c's tiles where the CPU has VNNI)."""
    rows: list[int] = []
    for name in ("packed_linear", "rows_linear"):
        f = getattr(experts, name)
        monkeypatch.setattr(experts, name, lambda x, w, *a, f=f, **k: (rows.append(x.shape[0]), f(x, w, *a, **k))[1])
    with sluice.load(path, memory=memory, matmul="bf16", activations="int16", **kw) as m:
        return m.logits(PROMPT), rows, m


def test_blocks_change_no_logits_and_streamed_runs_split_alike(model, monkeypatch):
    seen: list[int] = []
    f = experts.GluMath.__call__
    monkeypatch.setattr(experts.GluMath, "__call__",
                        lambda self, b, j, x: (seen.append(x.shape[0]), f(self, b, j, x))[1])
    unsplit, _, m = _run(model, monkeypatch)
    assert max(seen) > 32  # experts with more rows than the blocks below
    monkeypatch.setattr(matmul, "GEMM_MIN_BLOCK", 32)
    monkeypatch.setattr(matmul, "GEMM_BLOCK_BYTES", 0)
    split, rows, _ = _run(model, monkeypatch)
    assert max(rows) <= 32 and len(rows) > 0
    budget = m.resident_bytes + (m.spec.top_k + 1) * m.layout.expert_nbytes
    streamed, rows, _ = _run(model, monkeypatch, memory=budget, io="direct")
    assert max(rows) <= 32 and torch.equal(streamed, split)  # streamed and resident split alike
    if _rows_independent(m.spec, max(seen), 32):  # this CPU's GEMM gives a row the same bits in 32 rows as in all
        assert torch.equal(split, unsplit)
    else:
        torch.testing.assert_close(split, unsplit, rtol=0.02, atol=0.02 * unsplit.abs().max().item())


def test_a_quantized_expert_is_dequantized_once_for_all_its_blocks(model, monkeypatch):
    """Quantized experts' prompt rows run on their weights dequantized to bf16 once (GluMath._bf16_weights),
    however many blocks the rows take."""
    if "safetensors" in str(model):
        pytest.skip("the safetensors model's experts are bf16: nothing to dequantize")
    calls: list[int] = []
    f = experts.GluMath._bf16_weights
    monkeypatch.setattr(experts.GluMath, "_bf16_weights", lambda self, *a: (calls.append(1), f(self, *a))[1])
    monkeypatch.setattr(matmul, "GEMM_MIN_BLOCK", 32)
    monkeypatch.setattr(matmul, "GEMM_BLOCK_BYTES", 0)
    _, rows, _ = _run(model, monkeypatch)
    assert calls and len(rows) > 2 * len(calls)  # several blocks (two GEMMs each) per dequantized expert
