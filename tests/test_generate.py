"""The generation wrapper (sluice/generate.py and Model's one loop): text streaming with stop strings split across
tokens and cancellation per token (TextStream), replay by teacher forcing, public step times, the thread governor's
tick before every forward pass on every path."""

from __future__ import annotations

import pytest
import torch

import sluice
from sluice.generate import TextStream
from sluice.tools.tokenizer_train import train_tokenizer

from .models.tiny import hf_model, write_checkpoint

# ---- TextStream over a fake model: ids -> pieces ---------------------------------------------------------------------

HELD = 99  # decodes to nothing until flushed: the first byte of a character whose next byte never came


class Decoder:
    def __init__(self, pieces: dict[int, str]):
        self.pieces, self.held = pieces, ""

    def add(self, token: int) -> str:
        if token == HELD:
            self.held = "!"
            return ""
        return self.pieces[token]

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


class Source:
    """A generator of ids that records how many were taken and whether it was closed (the model's loop stopped)."""

    def __init__(self, ids: list[int]):
        self.ids, self.taken, self.closed = ids, 0, False
        self.gen = self._run()

    def _run(self):
        try:
            for i in self.ids:
                self.taken += 1
                yield i
        finally:
            self.closed = True


PIECES = {0: "Hel", 1: "lo W", 2: "orld", 3: " again", 4: "ab"}


def stream(ids: list[int], limit: int | None = None, stop=None, cancelled=None) -> tuple[TextStream, Source, list]:
    src = Source(ids)
    s = TextStream(src.gen, Decoder(PIECES), len(ids) if limit is None else limit, stop, cancelled)
    return s, src, list(s)


def test_stop_string_split_across_tokens_is_cut_and_stops_the_model():
    s, src, out = stream([0, 1, 2, 3], stop="o Wor")
    assert "".join(out) == "Hell" and s.finish_reason == "stop"
    assert s.completion_tokens == 3 and src.taken == 3 and src.closed  # the 4th id was never asked for


def test_stop_string_completed_by_the_decoder_flush():
    s, _, out = stream([4, HELD], stop=["zz", "b!"])
    assert "".join(out) == "a" and s.finish_reason == "stop" and s.completion_tokens == 2


def test_held_back_partial_stop_comes_out_when_generation_ends():
    s, src, out = stream([4], limit=5, stop="bz")  # "b" could start "bz": held until the end says it cannot
    assert "".join(out) == "ab" and s.finish_reason == "stop" and src.closed  # ended before the limit: EOS


def test_limit_is_length():
    s, _, out = stream([0, 1], limit=2)
    assert "".join(out) == "Hello W" and s.finish_reason == "length" and s.completion_tokens == 2


def test_cancellation_is_checked_after_every_token_not_every_piece():
    """HELD yields no piece: a check per piece would let a third token through."""
    src = Source([0, HELD, 1, 2])
    s = TextStream(src.gen, Decoder(PIECES), 4, cancelled=lambda: src.taken >= 2)
    assert "".join(s) == "Hel" and s.finish_reason == "cancelled" and s.completion_tokens == 2 and src.taken == 2


def test_cancelled_before_start_never_starts_the_model():
    src = Source([0, 1])
    s = TextStream(src.gen, Decoder(PIECES), 2, cancelled=lambda: True)
    assert list(s) == [] and s.finish_reason == "cancelled" and s.completion_tokens == 0 and src.taken == 0


def test_consumer_leaving_closes_the_model_loop():
    src = Source([0, 1, 2, 3])
    it = iter(TextStream(src.gen, Decoder(PIECES), 4))
    assert next(it) == "Hel"
    it.close()
    assert src.closed and src.taken == 1


# ---- the model's one loop ------------------------------------------------------------------------------------------

PROMPT = torch.randint(0, 300, (8,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = write_checkpoint(hf_model("qwen3_moe", torch.float32), tmp_path_factory.mktemp("gen"), "per_expert")
    train_tokenizer(folder, vocab_size=300)
    threads = torch.get_num_threads()
    m = sluice.load(folder, memory="all", threads=1, prefill_chunk=4)
    yield m
    m.close()
    torch.set_num_threads(threads)


def test_replay_argmax_is_greedy_generation_and_times_every_step(model):
    m = model
    greedy = list(m.generate_tokens(PROMPT, max_tokens=6, stop_at_eos=False))
    assert len(greedy) == 6
    t = m.step_times
    assert t.prefill_tokens == 8 and t.prefill_s > 0 and len(t.decode_s) == 5  # the first token came with the prefill
    seen = []
    argmax = m.replay(PROMPT, greedy, on_step=seen.append)
    assert argmax[:-1] == greedy and len(argmax) == 7
    assert seen == list(range(8, 15))  # tokens in the cache after the prefill, then after each fed token
    t = m.step_times
    assert t.prefill_tokens == 8 and len(t.decode_s) == 6 and all(s > 0 for s in t.decode_s)
    st = m.stats()
    assert st["tokens"] == 6 and st["prompt_tokens"] == 8 and m.last_tokens == greedy


def test_replay_feeds_the_given_tokens_whatever_the_model_picks(model):
    m = model
    greedy = list(m.generate_tokens(PROMPT, max_tokens=4, stop_at_eos=False))
    forced = [(t + 1) % 300 for t in greedy]
    argmax = m.replay(PROMPT, forced)
    assert argmax[0] == greedy[0]  # after the prompt: nothing forced yet
    # after a forced token the model continues from it: the same as greedy generation from the extended prompt
    again = list(m.generate_tokens(PROMPT + forced[:1], max_tokens=1, stop_at_eos=False))
    assert argmax[1] == again[0]


def test_governor_ticks_before_every_forward_pass(model, monkeypatch):
    m = model
    ticks = []
    monkeypatch.setattr(m, "_tick", lambda: ticks.append(1))
    fresh = [(PROMPT[0] + 1) % 300] + PROMPT[1:]  # no prefix of it is cached: the whole prompt runs
    list(m.generate_tokens(fresh, max_tokens=5, stop_at_eos=False))
    assert len(ticks) == 2 + 4  # two prefill chunks of 4, then one decode step per token after the first
    ticks.clear()
    m.replay(PROMPT, [1, 2, 3])
    assert len(ticks) == 2 + 3
    ticks.clear()
    "".join(m.generate(fresh, max_tokens=3, stop_at_eos=False))
    assert len(ticks) == 2 + 2


def _pieces(m, tokens: list[int]) -> list[str]:
    d = m.tokenizer.stream_decoder()
    return [d.add(t) for t in tokens]


def test_generate_cuts_a_stop_string_that_spans_tokens(model):
    m = model
    full = "".join(m.generate(PROMPT, max_tokens=24, stop_at_eos=False))
    pieces = _pieces(m, m.last_tokens)
    i = next(i for i in range(len(pieces) - 1) if pieces[i] and pieces[i + 1])
    stop = pieces[i][-1] + pieces[i + 1][0]  # neither token holds it whole
    cut = full.find(stop)
    assert "".join(m.generate(PROMPT, max_tokens=24, stop=stop, stop_at_eos=False)) == full[:cut]
    assert len(m.last_tokens) <= i + 2  # the model stopped at the token that completed the stop


def test_generate_cancelled_after_three_tokens_keeps_the_cache_consistent(model):
    m = model
    full = list(m.generate_tokens(PROMPT, max_tokens=8, stop_at_eos=False))
    calls = []

    def cancelled() -> bool:  # asked once before the first token, then after each
        calls.append(1)
        return len(calls) > 3

    text = "".join(m.generate(PROMPT, max_tokens=8, stop_at_eos=False, cancelled=cancelled))
    assert m.last_tokens == full[:3] and text == "".join(_pieces(m, full[:3]))
    assert m._kv_tokens == PROMPT + full[:2]  # the third token was never fed back
    # the next generation reuses that prefix of the cache and gets the same tokens as from scratch
    assert list(m.generate_tokens(PROMPT + full[:3], max_tokens=5, stop_at_eos=False)) == full[3:]


def test_governor_sets_the_native_threads_with_torchs(tmp_path):
    """Beside a busy process (one CPU free) decode stops splitting experts and projections over native threads; it
    splits again when the CPU comes back. The plan's threads set both at load."""
    from sluice.quant.native import pool

    folder = write_checkpoint(hf_model("qwen3_moe", torch.float32), tmp_path, "per_expert")
    threads = torch.get_num_threads()
    try:
        with sluice.load(folder, memory="all", threads=2) as m:
            assert pool.threads() == 2 and torch.get_num_threads() == 2
            m._set_threads(1)
            assert pool.threads() == 1 and torch.get_num_threads() == 1
            m._set_threads(2)
            assert pool.threads() == 2 and torch.get_num_threads() == 2
        with sluice.load(folder, memory="all", threads=1):
            assert pool.threads() == 1
    finally:
        torch.set_num_threads(threads)
        pool.set_threads(1)
