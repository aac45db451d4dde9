"""Tokenizer, chat template, streaming decoder and stop strings, checked against transformers' AutoTokenizer."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import jinja2
import pytest

from sluice.errors import CheckpointError, RequestError
from sluice.tokenizer import StopMatcher, Tokenizer
from sluice.tools.tokenizer_train import train_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "",
    "  leading spaces\tand\ttabs\n\nand newlines  ",
    "naïve café — déjà vu, Ünïcödé",
    "日本語のテキストと中文",
    "emoji 🎉👩‍👩‍👧 flags 🇫🇷 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|im_end|>",
    "def f(x):\n    return x ** 2  # squared\n",
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And in French? Réponds 🙂"},
]

# Llama-2 style: bos_token from the config, raise_exception on a malformed conversation.
BOS_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '[SYS]' + message['content'] + '[/SYS]\n' }}"
    "{% elif (message['role'] == 'user') != (loop.index0 % 2 == (1 if messages[0]['role'] == 'system' else 0)) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' + message['content'].strip() + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'].strip() + eos_token }}{% endif %}"
    "{% endfor %}"
)
TOOL_TEMPLATE = (
    "{% if tools %}{{ '<tools>' + (tools | tojson) + '</tools>\n' }}"
    "{% for t in tools %}{{ t | tojson(indent=2, sort_keys=True) }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
)
# Uses namespace, loop controls, a {% generation %} block and an extra template variable.
JINJA_FILE_TEMPLATE = """{% set ns = namespace(last_user=0) %}
{% for m in messages %}
  {% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
{% endfor %}
{% for m in messages %}
  {% if loop.index0 > ns.last_user %}{% break %}{% endif %}
  {% if m.role == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ m.content }}{% endgeneration %}<|im_end|>
  {% else %}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>
{% endif %}{% endif %}"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=1024)


@pytest.fixture(scope="module")
def tok(folder: Path) -> Tokenizer:
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def hf(folder: Path):
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _variant(folder: Path, dest: Path, **config_changes) -> Path:
    """A copy of the trained folder with tokenizer_config.json fields replaced (None deletes)."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(folder / "tokenizer.json", dest / "tokenizer.json")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for k, v in config_changes.items():
        if v is None:
            config.pop(k, None)
        else:
            config[k] = v
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


# ---- encode / decode --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok: Tokenizer, hf, text: str) -> None:
    for add in (True, False):
        ids = tok.encode(text, add_special_tokens=add)
        assert ids == hf(text, add_special_tokens=add)["input_ids"]
    ids = tok.encode(text)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.decode(ids, skip_special_tokens=False) == text  # byte-level BPE round-trips (text is NFC)


def test_special_tokens_match_transformers(tok: Tokenizer, hf) -> None:
    assert tok.vocab_size == len(hf)
    assert tok.eos_token_id == hf.eos_token_id == tok.token_to_id("<|im_end|>") == 2
    assert tok.bos_token_id is None and hf.bos_token_id is None
    assert tok.pad_token_id == hf.pad_token_id == 0
    assert tok.token_to_id("<|im_start|>") == hf.convert_tokens_to_ids("<|im_start|>") == 1
    assert tok.token_to_id("definitely-not-a-token") is None


def test_special_token_dict_form_and_missing_token_added(folder: Path, tmp_path: Path) -> None:
    bos = {"__type": "AddedToken", "content": "<s>", "lstrip": False, "rstrip": False, "normalized": False,
           "single_word": False, "special": True}
    d = _variant(folder, tmp_path / "v", bos_token=bos)
    ours, theirs = Tokenizer.from_folder(d), transformers.AutoTokenizer.from_pretrained(str(d))
    assert ours.bos_token == "<s>"
    assert ours.bos_token_id == theirs.bos_token_id is not None  # not in tokenizer.json: both add it
    assert ours.encode("a <s> b") == theirs("a <s> b")["input_ids"]


def test_training_is_deterministic(tmp_path: Path) -> None:
    texts = ["the quick brown fox jumps over the lazy dog " * 20, "pack my box with five dozen liquor jugs " * 20]
    a = train_tokenizer(tmp_path / "a", vocab_size=300, texts=texts)
    b = train_tokenizer(tmp_path / "b", vocab_size=300, texts=texts)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_bad_tokenizer_file_names_it(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError) as e:
        Tokenizer.from_folder(tmp_path)
    assert e.value.file == str(tmp_path / "tokenizer.json")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path / "missing")


# ---- chat templates ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gen", [True, False])
def test_chatml_matches_transformers(tok: Tokenizer, hf, gen: bool) -> None:
    ours = tok.apply_chat_template(CONVERSATION, add_generation_prompt=gen)
    assert ours == hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=gen)
    assert ours.endswith("<|im_start|>assistant\n") == gen
    assert tok.encode(ours, add_special_tokens=False).count(tok.token_to_id("<|im_start|>")) == 4 + gen


def test_template_list_with_bos_and_raise_exception(folder: Path, tmp_path: Path) -> None:
    templates = [{"name": "default", "template": BOS_TEMPLATE}, {"name": "tool_use", "template": TOOL_TEMPLATE}]
    d = _variant(folder, tmp_path / "v", bos_token={"content": "<|endoftext|>"}, chat_template=templates)
    # transformers 5 wants the serialized-AddedToken form of a dict token; sluice accepts both.
    d2 = _variant(folder, tmp_path / "v2", bos_token="<|endoftext|>", chat_template=templates)
    ours, theirs = Tokenizer.from_folder(d), transformers.AutoTokenizer.from_pretrained(str(d2))

    for gen in (True, False):
        got = ours.apply_chat_template(CONVERSATION, add_generation_prompt=gen)
        assert got == theirs.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=gen)
    assert got.startswith("<|endoftext|>[SYS]") and "<|im_end|>" in got

    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError):
        theirs.apply_chat_template(bad, tokenize=False)
    with pytest.raises(RequestError, match="must alternate"):
        ours.apply_chat_template(bad)

    tools = [{"type": "function", "function": {"name": "lookup", "description": "a <b> & 'c' — ünï",
                                               "parameters": {"type": "object", "properties": {}}}}]
    got = ours.apply_chat_template(CONVERSATION, tools=tools)
    assert got == theirs.apply_chat_template(CONVERSATION, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "<b> & 'c' — ünï" in got  # tojson neither HTML-escapes nor ASCII-escapes


def test_chat_template_jinja_file_wins(folder: Path, tmp_path: Path) -> None:
    d = _variant(folder, tmp_path / "v")
    (d / "chat_template.jinja").write_text(JINJA_FILE_TEMPLATE)
    ours, theirs = Tokenizer.from_folder(d), transformers.AutoTokenizer.from_pretrained(str(d))
    convo = CONVERSATION + [{"role": "assistant", "content": "Quatre."}]
    for extra in ({}, {"enable_thinking": False}):
        for gen in (True, False):
            got = ours.apply_chat_template(convo, add_generation_prompt=gen, **extra)
            assert got == theirs.apply_chat_template(convo, tokenize=False, add_generation_prompt=gen, **extra)
    got = ours.apply_chat_template(convo, enable_thinking=False)
    assert "Quatre" not in got and got.endswith("<think>\n\n</think>\n")  # break stopped after the last user turn


def test_missing_chat_template_is_clear(folder: Path, tmp_path: Path) -> None:
    ours = Tokenizer.from_folder(_variant(folder, tmp_path / "v", chat_template=None))
    with pytest.raises(RequestError, match="has no chat template"):
        ours.apply_chat_template(CONVERSATION)


@pytest.mark.parametrize(
    "messages, field",
    [
        ("hello", "messages"),
        ([], "messages"),
        ([{"role": "user", "content": "a"}, "b"], r"messages\[1\]"),
        ([{"role": "bot", "content": "a"}], r"messages\[0\]\.role"),
        ([{"content": "a"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}], r"messages\[1\]\.content"),
        ([{"role": "user"}], r"messages\[0\]\.content"),
    ],
)
def test_bad_messages_name_the_field(tok: Tokenizer, messages, field: str) -> None:
    with pytest.raises(RequestError, match=field):
        tok.apply_chat_template(messages)


def test_tool_call_turn_without_content(tok: Tokenizer, hf) -> None:
    convo = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    template = "{% for m in messages %}{{ m.content }}|{% endfor %}"
    got = tok.apply_chat_template(convo, chat_template=template)
    assert got == hf.apply_chat_template(convo, chat_template=template, tokenize=False) == "x||"  # None dropped


# ---- streaming ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder_pieces_concatenate(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    for skip in (True, False):
        dec = tok.stream_decoder(skip_special_tokens=skip)
        pieces = [dec.add(i) for i in ids] + [dec.flush()]
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in p for p in pieces)


def test_stream_decoder_holds_split_characters(tok: Tokenizer) -> None:
    ids = tok.encode("🎉")
    assert len(ids) > 1 and "\ufffd" in tok.decode(ids[:1])  # the emoji really is split across byte tokens
    dec = tok.stream_decoder()
    assert [dec.add(i) for i in ids] == [""] * (len(ids) - 1) + ["🎉"]


def test_stream_decoder_random_ids(tok: Tokenizer) -> None:
    # Arbitrary ids (invalid UTF-8 included) still concatenate to the full decode.
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 24))]
        dec = tok.stream_decoder()
        assert "".join([dec.add(i) for i in ids] + [dec.flush()]) == tok.decode(ids)


# ---- stop strings -------------------------------------------------------------------------------------------------


def _run_stops(stops: list[str], pieces: list[str]) -> tuple[str, bool, str | None]:
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        text, stopped = m.feed(p)
        out.append(text)
        if stopped:
            return "".join(out), True, m.matched
    return "".join(out) + m.flush(), False, None


def test_stop_inside_a_piece() -> None:
    assert _run_stops(["STOP"], ["hello ", "wor STOP ld"]) == ("hello wor ", True, "STOP")


def test_stop_split_across_pieces_is_held_back() -> None:
    m = StopMatcher(["</end>"])
    assert m.feed("abc</") == ("abc", False)  # "</" could start the stop: held
    assert m.feed("en") == ("", False)
    assert m.feed("d>tail") == ("", True) and m.matched == "</end>"
    assert m.feed("more") == ("", True)


def test_partial_stop_that_does_not_complete_is_released() -> None:
    assert _run_stops(["</end>"], ["a</e", "x b"]) == ("a</ex b", False, None)
    assert _run_stops(["</end>"], ["tail </en"]) == ("tail </en", False, None)  # flushed at the end


def test_no_stop() -> None:
    assert _run_stops(["###"], ["one ", "two ", "three"]) == ("one two three", False, None)


def test_multiple_stops_earliest_wins() -> None:
    assert _run_stops(["world", "lo"], ["hel", "lo world"]) == ("hel", True, "lo")
    assert _run_stops(["\n\n", "User:"], ["answer.", "\nUs", "er: hi"]) == ("answer.\n", True, "User:")


def test_bad_stop_strings() -> None:
    with pytest.raises(RequestError, match=r"stop\[1\]"):
        StopMatcher(["ok", ""])
