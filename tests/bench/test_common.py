"""benchmarks/common.py's with_kernels and child_json: a model's Kernels switch is the same model rebuilt (once per
setting) and put back after the block, the process-wide choices are set for the block and restored, and a bad
choice or a failing child is one clear error (no timing here)."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

import sluice
from benchmarks.common import child_json, decode_options, with_kernels
from sluice.quant import matmul, native
from sluice.quant.native import pool
from sluice.store import streaming
from sluice.tools.synth import SynthConfig, make_model

experts = importlib.import_module("sluice.models.layers.experts")
moe = importlib.import_module("sluice.models.layers.moe")  # the module: the package re-exports a function `moe`
TINY = SynthConfig(arch="qwen3_moe", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   num_experts=4, top_k=2, moe_intermediate_size=32, vocab_size=300, dtype="bfloat16")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("m") / "tiny", TINY, progress=False)
    with sluice.load(path, memory="all") as m:
        yield m


def test_a_model_switch_is_the_model_rebuilt_once_and_put_back(model):
    old = model.model
    assert old.kernels.native_decode and old.kernels.split_experts
    want = model.logits([5, 6, 7])
    with with_kernels(model, native_decode=False, split_experts=False):
        rebuilt = model.model
        assert rebuilt is not old
        assert not rebuilt.kernels.native_decode and not rebuilt.kernels.split_experts
        assert rebuilt.kernels.code_rows_once and rebuilt.kernels.native_prompt_attention  # the others kept
        assert rebuilt.cache is old.cache and rebuilt.store is old.store and rebuilt.w is old.w  # the same model
        assert torch.equal(model.logits([5, 6, 7]), want)  # a plain bf16 model: these switches change no step
    assert model.model is old
    with with_kernels(model, split_experts=False, native_decode=False):
        assert model.model is rebuilt  # one build per setting: what it builds lazily carries over between rounds
    with with_kernels(model, native_decode=True):  # what it has already: no rebuild
        assert model.model is old
    assert model.model is old


def test_process_choices_are_set_for_the_block_and_put_back():
    before = (pool.threads(), streaming.PROMPT_READ_GROUP, experts.GEMM_ROW_STEP, moe.GEMM_ROW_STEP,
              matmul.GEMM_BLOCK_BYTES, matmul.GEMM_MIN_BLOCK)
    threads = 2 if before[0] == 1 else 1
    extra = {"super_blocks": False, "prefetch": 0} if native.available() else {}  # C hooks: the extension's
    assert len(matmul.row_blocks(100_000, 64)) > 1
    with with_kernels(threads=threads, read_group=1, gemm_row_step=1, gemm_blocks=False, **extra):
        assert streaming.PROMPT_READ_GROUP == 1
        assert experts.GEMM_ROW_STEP == moe.GEMM_ROW_STEP == 1  # moe.py's own binding of the constant too
        assert matmul.row_blocks(100_000, 64) == [(0, 100_000)]  # one GEMM for all the rows
        if native.available():
            assert pool.threads() == threads
    assert (pool.threads(), streaming.PROMPT_READ_GROUP, experts.GEMM_ROW_STEP, moe.GEMM_ROW_STEP,
            matmul.GEMM_BLOCK_BYTES, matmul.GEMM_MIN_BLOCK) == before


def test_bad_choices_are_one_clear_error(model):
    with pytest.raises(ValueError, match="unknown choice 'prompt_wait'"):
        with with_kernels(prompt_wait=(50_000, 200_000)):
            pass
    with pytest.raises(ValueError, match="pass the model"):
        with with_kernels(native_decode=False):
            pass
    with pytest.raises(ValueError, match="unknown choice 'native_attention'"):  # now native_decode
        with with_kernels(model, native_attention=False):
            pass


def test_child_json_returns_the_last_line_or_exits_with_the_childs_error():
    assert child_json([sys.executable, "-c", "print('progress'); print('[1, 2]')"]) == [1, 2]
    with pytest.raises(SystemExit, match="knobs.py: file x.gguf: not found"):
        child_json([sys.executable, "-c", "import sys; print('noise', file=sys.stderr); "
                    "sys.exit('knobs.py: file x.gguf: not found')"])


def test_decode_options_name_the_read_ahead_so_stream_keeps_meaning_no_guesses():
    """The results scripts' "stream" mode reads each layer's experts after its router (--prefetch none), whatever
    sluice's default read-ahead is; "router" guesses; "auto" is the default; "resident" holds everything; anything
    else exits naming them."""
    stream = decode_options("stream")
    assert stream == dict(memory="640MiB", io="direct", odirect=True, prefetch="none") == decode_options("streamed")
    assert decode_options("router") == {**stream, "prefetch": "router"}
    assert decode_options("auto") == {**stream, "prefetch": "auto"}
    assert decode_options("resident") == dict(memory="all")
    with pytest.raises(SystemExit, match="resident, stream, router or auto"):
        decode_options("bogus")
