"""`sluice perplexity`: exp(mean NLL) of the tokens llama.cpp's windows score, computed from sluice's own logits;
identical streamed and resident; the sliding-window variant; bad input is one clean error line."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import sluice
from sluice import cli
from sluice.tools.perplexity import Window, bos_of, perplexity, windows
from sluice.tools.synth import SynthConfig, make_model

TINY = SynthConfig(arch="qwen3_moe", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   num_experts=8, top_k=2, moe_intermediate_size=32, vocab_size=300)
CONTEXT = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppl")
    folder = make_model(root / "m", TINY, progress=False)
    words = "the model reads experts from disk while the cache keeps what the router picks often".split()
    text = " ".join(words[(i * 7) % len(words)] for i in range(400))
    (root / "text.txt").write_text(text, "utf-8")
    return folder, root / "text.txt"


def _cli_json(capsys, *argv) -> dict:
    assert cli.main(["perplexity", *argv, "--json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out)


def _by_hand(folder, text: str, context: int) -> tuple[float, int]:
    """llama.cpp's definition written out: non-overlapping windows, logits at C/2 .. C-2 score tokens C/2+1 .. C-1."""
    with sluice.load(folder, memory="all") as m:
        tokens = m.tokenizer.encode(text)
        nll, n = 0.0, 0
        for start in range(0, len(tokens) - context + 1, context):
            ids = tokens[start:start + context]
            logits = m.logits(ids).double()
            half = context // 2
            nll += torch.nn.functional.cross_entropy(logits[half:-1], torch.tensor(ids[half + 1:]),
                                                     reduction="sum").item()
            n += context - 1 - half
    return math.exp(nll / n), n


def test_equals_exp_mean_nll_by_hand(tiny, capsys):
    folder, text = tiny
    want, n = _by_hand(folder, text.read_text(), CONTEXT)
    got = _cli_json(capsys, str(folder), "--text", str(text), "--context", str(CONTEXT), "--memory", "all")
    assert got["tokens_scored"] == n > 0 and got["definition"] == "llama.cpp"
    assert got["perplexity"] == pytest.approx(want, rel=1e-9)


def test_streamed_equals_resident_and_gguf_runs(tiny, capsys, tmp_path):
    folder, text = tiny
    argv = ["--text", str(text), "--context", str(CONTEXT)]
    resident = _cli_json(capsys, str(folder), *argv, "--memory", "all")
    with sluice.load(folder, memory="all") as m:
        budget = m.resident_bytes + TINY.top_k * m.layout.expert_nbytes  # the smallest cache: every step reads
    for io in ("mmap", "direct"):
        assert _cli_json(capsys, str(folder), *argv, "--memory", str(budget), "--io", io) == resident
    pytest.importorskip("gguf")
    from sluice.tools.quantize import quantize

    quantize(folder, tmp_path / "m.gguf", "bf16")  # the same weights and tokenizer as a GGUF: the same number
    assert _cli_json(capsys, str(tmp_path / "m.gguf"), *argv, "--memory", "all") == resident


def test_sliding_window_scores_every_token_once(tiny, capsys):
    folder, text = tiny
    got = _cli_json(capsys, str(folder), "--text", str(text), "--context", str(CONTEXT), "--stride", "8",
                    "--memory", "all")
    with sluice.load(folder, memory="all") as m:
        tokens = m.tokenizer.encode(text.read_text())
    assert got["tokens_scored"] == len(tokens) - 1 and got["definition"] == "sliding"


def test_windows():
    assert windows(100, 32) == [Window(0, 32, 17), Window(32, 64, 49), Window(64, 96, 81)]  # tail of 4 dropped
    assert windows(10, 4, stride=3) == [Window(0, 4, 1), Window(3, 7, 4), Window(6, 10, 7)]
    assert windows(5, 4, stride=4) == [Window(0, 4, 1)]  # [4, 5) would score nothing
    assert sum(w.end - w.first for w in windows(1000, 64, stride=16)) == 999


def test_bos_replaces_each_windows_first_token():
    """llama.cpp puts BOS at the start of every window when the tokenizer adds one (and only then)."""
    seen = []

    def logits(ids):
        seen.append(list(ids))
        return torch.zeros(len(ids), 10)  # uniform: perplexity = vocabulary size

    res = perplexity(logits, list(range(1, 9)) * 2, context=8, bos=0)
    assert [s[0] for s in seen] == [0, 0] and seen[1][1:] == [2, 3, 4, 5, 6, 7, 8]
    assert res.perplexity == pytest.approx(10) and res.tokens == 2 * 3
    assert bos_of(lambda text, special: ([7] if special else []) + [1, 2]) == 7
    assert bos_of(lambda text, special: [1, 2]) is None


@pytest.mark.parametrize("argv,needle", [
    (["--context", "4096"], "shorter than one window of --context 4096"),
    (["--context", "1"], "--context 1: a window needs at least 2 tokens"),
    (["--stride", "64"], "--stride 64: must be between 1 and --context (32)"),
    (["--context", "2"], "--context 2: llama.cpp's windows score only their second half"),  # a ZeroDivisionError
    (["--max-text", "1KiB"], "more than 1.0 KiB (--max-text); give a shorter text, or raise --max-text"),
    (["--max-text", "lots"], "--max-text: expected a size"),
])
def test_bad_input_is_one_line(tiny, capsys, argv, needle):
    folder, text = tiny
    assert cli.main(["perplexity", str(folder), "--text", str(text), "--context", "32", *argv, "--no-progress",
                     "--memory", "all"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("sluice perplexity: error: ") and needle in line


def test_missing_text_file(tiny, capsys, tmp_path):
    folder, _ = tiny
    assert cli.main(["perplexity", str(folder), "--text", str(tmp_path / "none.txt"), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == f"sluice perplexity: error: --text {tmp_path / 'none.txt'}: no such file"


def test_context_2_scores_with_a_stride(tiny, capsys):
    folder, text = tiny
    got = _cli_json(capsys, str(folder), "--text", str(text), "--context", "2", "--stride", "1", "--memory", "all")
    assert got["tokens_scored"] > 0 and math.isfinite(got["perplexity"])


def _run(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluice", "perplexity", *argv, "--no-progress"], capture_output=True,
                          timeout=120, **kw)


def test_stdin_is_read_and_bounded(tiny, capsys):
    folder, text = tiny
    want = _cli_json(capsys, str(folder), "--text", str(text), "--context", str(CONTEXT), "--memory", "all")
    r = _run(str(folder), "--text", "-", "--context", str(CONTEXT), "--memory", "all", "--json",
             input=text.read_bytes())
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == want
    # an endless pipe stops at --max-text (it was read until memory ran out)
    with subprocess.Popen(["yes", "all work and no play"], stdout=subprocess.PIPE) as endless:
        r = _run(str(folder), "--text", "-", "--max-text", "1MiB", stdin=endless.stdout)
        endless.kill()
    assert r.returncode == 2 and r.stderr.decode().strip() == (
        "sluice perplexity: error: --text -: more than 1.0 MiB (--max-text); give a shorter text, or raise --max-text")


def test_a_fifo_or_a_device_is_refused_at_once(tiny, tmp_path):
    folder, _ = tiny
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    # a FIFO with no writer blocked the open forever; /dev/zero was read until memory ran out (--max-text only
    # guards this test from that: the device is refused before it is read)
    for name, kind in ((fifo, "a FIFO"), ("/dev/zero", "a device")):
        r = _run(str(folder), "--text", str(name), "--max-text", "1MiB")
        assert r.returncode == 2 and r.stderr.decode().strip() == (
            f"sluice perplexity: error: --text {name}: is {kind}, not a text file; give a file, or pipe the text to "
            "standard input with --text -")
