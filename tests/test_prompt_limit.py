"""A prompt longer than the context is refused after O(context) tokenizer work (sluice/prompt_limit.py), the bound
never refuses a prompt that fits, and text that is not valid Unicode is a RequestError, not a TypeError. Also the
upper bounds of the runaway-prone load options."""

from __future__ import annotations

import os
import random

import pytest
import torch
from tokenizers import AddedToken, decoders, models, normalizers, trainers
from tokenizers import Tokenizer as Backend

import sluice
from sluice.errors import ConfigError, ContextLengthError, RequestError
from sluice.options import MAX_IO_WORKERS, LoadOptions
from sluice.tokenizer.limit import PIECE, tokens_at_least
from sluice.tokenizer import Tokenizer, check_text
from sluice.tools.tokenizer_train import train_tokenizer

from .models.tiny import hf_model, write_checkpoint

DEMO = os.path.join(os.path.dirname(sluice.__file__), "assets", "demo")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = write_checkpoint(hf_model("qwen3_moe", torch.bfloat16), tmp_path_factory.mktemp("limit"), "per_expert")
    train_tokenizer(folder, vocab_size=300)
    return folder


def sentencepiece_like() -> Tokenizer:
    """Mixtral's kind of tokenizer: no pre-tokenizer (the whole text is one word), "▁" for spaces, byte fallback."""
    backend = Backend(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"])
    backend.train_from_iterator(["hello world the quick brown fox", "lorem ipsum dolor sit amet"] * 40, trainer)
    backend.add_special_tokens([AddedToken("<|im_start|>", special=True, normalized=False)])
    return Tokenizer(backend)


@pytest.fixture(scope="module")
def tokenizers(model_dir) -> dict[str, Tokenizer]:
    return {"trained": Tokenizer.from_folder(model_dir), "demo": Tokenizer.from_folder(DEMO),
            "sentencepiece": sentencepiece_like()}


def random_text(rng: random.Random, n: int) -> str:
    """Words, specials, whitespace runs, combining marks, ligatures, emoji, and long runs of one letter."""
    alphabet = "abc d\u00e9f \u554a\u4e2d\u6587 ,.;\n\t  e\u0301 \ufb01 \U0001f642 0123"
    parts: list[str] = []
    while sum(map(len, parts)) < n:
        r = rng.random()
        if r < 0.5:
            parts.append(rng.choice(["the ", "quick ", "hello ", "world\n", "<|im_start|>", "  ", "\n\n"]))
        elif r < 0.9:
            parts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))))
        else:
            parts.append(rng.choice("\u554aa ") * rng.randint(50, 3000))
    return "".join(parts)[:n]


@pytest.mark.parametrize("name", ["trained", "demo", "sentencepiece"])
def test_floor_never_exceeds_the_true_count(tokenizers, name):
    tok = tokenizers[name]
    rng = random.Random(0)
    for n in (50, 3000, 2 * PIECE + 123, 5 * PIECE):
        for _ in range(3):
            text = random_text(rng, n)
            exact = len(tok.encode(text, add_special_tokens=False))
            floor = tokens_at_least(tok, text, 10**9)
            assert floor.tokens <= exact, (n, floor, exact)
            assert floor.tokens >= (exact if n <= PIECE else 0.5 * exact)  # and it is close: exact when one piece


@pytest.mark.parametrize("name", ["trained", "demo", "sentencepiece"])
@pytest.mark.parametrize("text", [
    "pathlib json " * 300_000,  # words: refused after a piece or two
    "\u554a" * 1_000_000,  # one word of 3M tokens (9.7 s and 720 MiB to tokenize whole)
    "a" * 3_000_000,
])
def test_long_text_is_refused_after_little_work(tokenizers, name, text, monkeypatch):
    tok = tokenizers[name]
    longest = []
    encode = tok.backend.encode

    class Spy:  # the backend with its encode calls recorded
        def __getattr__(self, attr):
            return getattr(real, attr)

        def encode(self, s, add_special_tokens=True):
            longest.append(len(s))
            return encode(s, add_special_tokens=add_special_tokens)

    real = tok.backend
    monkeypatch.setattr(tok, "backend", Spy())
    floor = tokens_at_least(tok, text, 256)
    assert floor.tokens > 256
    assert max(longest, default=0) <= PIECE and len(longest) <= 3  # never the whole text


def test_model_refuses_long_prompts_with_context_length_error(model_dir):
    with sluice.load(model_dir, threads=1) as m:
        with pytest.raises(ContextLengthError, match=r"exceeds the context of 256 tokens .* at least"):
            m.encode_prompt("pathlib json " * 300_000)
        with pytest.raises(ContextLengthError, match="exceeds the context"):
            m.encode_chat([{"role": "user", "content": "\u554a" * 1_000_000}])
        # shorter than a piece: tokenized whole and counted exactly, as before
        with pytest.raises(ContextLengthError, match=r"prompt of \d+ tokens exceeds"):
            m.encode_prompt("ok " * 300)
        assert m.encode_prompt("hello world") == m.tokenizer.encode("hello world")


@pytest.mark.parametrize("text,where", [("a\ud800b", r"character 1 is U\+D800"), ("\udcff", "the byte 0xFF")])
def test_lone_surrogates_are_request_errors(model_dir, text, where):
    with pytest.raises(RequestError, match=where):
        check_text(text)
    with sluice.load(model_dir, threads=1) as m:
        with pytest.raises(RequestError, match="not valid text"):
            m.encode_prompt(text)
        with pytest.raises(RequestError, match="not valid text"):
            m.encode_chat([{"role": "user", "content": text}])
        with pytest.raises(RequestError, match="not valid text"):
            tokens_at_least(m.tokenizer, text * PIECE, 10)


def test_seed_beyond_64_bits_is_a_request_error(model_dir):
    with sluice.load(model_dir, threads=1) as m:
        with pytest.raises(RequestError, match="64 bits"):
            list(m.generate("hi", max_tokens=2, temperature=1.0, seed=2**64))
        assert len(list(m.generate_tokens("hi", max_tokens=2, temperature=1.0, seed=2**64 - 1))) <= 2


@pytest.mark.parametrize("options,needle", [
    (dict(io_workers=MAX_IO_WORKERS + 1), f"io_workers: must be an integer from 0 .* to {MAX_IO_WORKERS} "),
    (dict(io_workers=10**9), "disk saturates"),
    (dict(threads=(os.cpu_count() or 1) + 1), "logical CPUs"),
    (dict(threads=100_000), f"to {os.cpu_count() or 1} "),
    (dict(threads="4"), "threads"),
    (dict(io_workers=-1), "io_workers"),
    (dict(max_context=True), "max_context"),
])
def test_runaway_options_are_bounded(options, needle):
    with pytest.raises(ConfigError, match=needle):
        LoadOptions.make(**options)


def test_bounds_themselves_are_accepted():
    opts = LoadOptions.make(io_workers=MAX_IO_WORKERS, threads=os.cpu_count() or 1)
    assert opts.io_workers == MAX_IO_WORKERS
