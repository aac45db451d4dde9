"""The Gated DeltaNet hybrids as mlx-lm's converter writes them (mlx-lm 0.32.2 runs qwen3_next and qwen3_5_moe): its
`sanitize` stores the zero-centred norms as their scale 1 + w and the conv as [C, K, 1], names Qwen3.5's text model
`language_model.model.*` and stacks the experts; sluice reads the folder as the model it came from (the
architecture's MLX_VALUES undone). References (tests/quant/mlx_files.py): mlx-lm itself on CPU, its scales widened to
float32; greedy tokens after a prompt longer than the delta rule's 64-token block; streamed == resident bitwise."""

from __future__ import annotations

import pytest
import torch

import sluice
from tests.quant.mlx_files import mlx_folder, mlx_lm_float32, mlx_lm_greedy, mlx_lm_logits
from tests.quant.streaming import assert_streamed_equals_resident

IDS = torch.randint(0, 300, (80,), generator=torch.Generator().manual_seed(13)).tolist()  # > one 64-token block

CASES = {  # name -> (arch, bits, group size, dtype of scales / biases and norms)
    "qwen3_next-4bit-g64-f32": ("qwen3_next", 4, 64, "float32"),
    "qwen3_5_moe-8bit-g32-bf16": ("qwen3_5_moe", 8, 32, "bfloat16"),
}


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    """(case name, MLX folder, mlx-lm's float32-widened model)."""
    arch, bits, group, dtype = CASES[request.param]
    folder, _ = mlx_folder(arch, tmp_path_factory.mktemp(request.param), bits, group, dtype)
    return request.param, folder, mlx_lm_float32(folder)


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_float32_matches_mlx_lm(converted):
    name, folder, mlx_model = converted
    with sluice.load(folder, memory="all", dtype="float32") as m:
        assert any(f.startswith("mlx") for f in m.layout.format_names)
        got = m.logits(IDS)
    assert _rel_l2(got, mlx_lm_logits(mlx_model, IDS)) <= 1e-3, name


def test_greedy_tokens_equal_mlx_lm(converted):
    name, folder, mlx_model = converted
    with sluice.load(folder, memory="all", dtype="float32") as m:
        got = list(m.generate_tokens(IDS, max_tokens=12, stop_at_eos=False))
    assert got == mlx_lm_greedy(mlx_model, IDS, 12), name


@pytest.mark.parametrize("io,odirect", [("mmap", False), ("direct", True)])
def test_streamed_equals_resident_bitwise(converted, io, odirect):
    assert_streamed_equals_resident(converted[1], IDS[:40], io, odirect, "min")


def test_unquantized_mlx_folder_is_the_hf_checkpoint(tmp_path):
    """mlx_lm.convert without -q: its sanitized names and values in float32; the model of the HF folder."""
    folder, _ = mlx_folder("qwen3_next", tmp_path, None, 64, "float32")
    with sluice.load(folder, memory="all", dtype="float32") as m:
        got = m.logits(IDS)
    with sluice.load(tmp_path / "hf", memory="all", dtype="float32") as m:
        assert _rel_l2(got, m.logits(IDS)) <= 1e-6
