"""`tokenizer_from_gguf`: the tokenizer a GGUF's metadata describes encodes as the original tokenizer.json and as
transformers' GGUF tokenizer (where transformers follows llama.cpp), on a few hundred varied texts, for byte-level
BPE files written by `sluice export-gguf` ("gpt-2", "qwen2"), the same vocabulary under other llama.cpp
pre-tokenizers, and a Mixtral-shaped SentencePiece vocabulary. Agreement with llama.cpp itself is measured by
benchmarks/tokenizer_llamacpp.py (llama.cpp is not built in CI)."""

from __future__ import annotations

import copy
import unicodedata
from pathlib import Path

import pytest

from sluice.errors import CheckpointError, ConfigError, RequestError
from sluice.tokenizer import Tokenizer
from sluice.tokenizer.gguf import tokenizer_from_gguf
from tests import tokenizer_cases as tc

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

BPE_TEXTS = tc.texts((*tc.BPE_SPECIALS, "<think>", "</think>"))
SPM_TEXTS = tc.texts((*tc.SPM_CONTROL, *tc.SPM_USER_DEFINED))


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """pre name -> (model folder, the GGUF `sluice export-gguf` wrote from it)."""
    return tc.exported_bpe_files(tmp_path_factory.mktemp("gguf_tok"))


def _load(path: Path):
    return tokenizer_from_gguf(tc.gguf_metadata(path), str(path))


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    """(GGUF path, the SentencePiece tokenizer's Hugging Face tokenizer.json equivalent)."""
    kv, hf = tc.spm_vocab()
    return tc.write_vocab_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", kv), hf


def _mismatches(tok, reference, texts, add_special_tokens=True) -> list[str]:
    return [t for t in texts if tok.encode(t, add_special_tokens) != reference(t, add_special_tokens)]


# ---- byte-level BPE ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pre", ["gpt-2", "qwen2"])
def test_exported_gguf_encodes_as_tokenizer_json(exported, pre):
    folder, path = exported[pre]
    tok, ref = _load(path), Tokenizer.from_folder(folder)
    assert tok.vocab.pre == pre
    # tokenizer.json normalizes to NFC and llama.cpp does not: equal on NFC text, and on every text once the
    # normalizer is dropped
    nfc = [t for t in BPE_TEXTS if unicodedata.is_normalized("NFC", t)]
    assert len(nfc) > 300
    assert _mismatches(tok, lambda t, a: ref.encode(t, a), nfc) == []
    raw = tc.with_pre_tokenizer(folder / "tokenizer.json", None)
    assert _mismatches(tok, lambda t, a: raw.encode(t, add_special_tokens=a).ids, BPE_TEXTS) == []
    assert tok.encode("e\u0301") != ref.encode("e\u0301")  # the normalizer is the only difference, and it shows


@pytest.mark.parametrize("pre", ["gpt-2", "qwen2"])
def test_exported_gguf_decodes_as_tokenizer_json(exported, pre):
    folder, path = exported[pre]
    tok, ref = _load(path), Tokenizer.from_folder(folder)
    for text in BPE_TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text  # byte-level BPE loses nothing
        assert tok.decode(ids) == ref.decode(ids)
        pieces = tok.stream_decoder()
        assert "".join(pieces.add(i) for i in ids) + pieces.flush() == tok.decode(ids)


@pytest.mark.parametrize("pre", ["gpt-2", "qwen2"])
def test_exported_gguf_matches_transformers(exported, pre):
    folder, path = exported[pre]
    tok = _load(path)
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert _mismatches(tok, lambda t, a: hf.encode(t, add_special_tokens=a), BPE_TEXTS) == []
    assert tok.apply_chat_template(tc_messages()) == hf.apply_chat_template(tc_messages(), tokenize=False,
                                                                            add_generation_prompt=True)


def tc_messages():
    return [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Wie geht's? 🙂"},
            {"role": "assistant", "content": "<think>\n</think>\nGut."}, {"role": "user", "content": "Und?"}]


def test_special_ids_template_and_end_of_generation(exported):
    folder, path = exported["qwen2"]
    tok, ref = _load(path), Tokenizer.from_folder(folder)
    assert tok.eos_token_id == ref.eos_token_id == ref.token_to_id("<|im_end|>")
    assert tok.pad_token_id == ref.token_to_id("<|endoftext|>") and tok.bos_token_id == 0
    assert tok.eog_token_ids == {ref.token_to_id("<|im_end|>"), ref.token_to_id("<|endoftext|>")}
    assert tok.vocab_size == 1040 and tok.id_to_token(1030) == "[PAD1030]"
    assert tok.encode("a[PAD1030]b")[1] == 1030  # user-defined tokens are matched whole, like control ones
    assert tok.apply_chat_template(tc_messages()) == ref.apply_chat_template(tc_messages())
    assert tok.encode("<think>x</think>")[0] == ref.token_to_id("<think>")
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"


@pytest.mark.parametrize("pre", sorted(tc.reference_pre_tokenizers()))
def test_pre_tokenizers_match_the_models_that_declare_them(exported, pre, tmp_path):
    """The exported vocabulary under each pre-tokenizer name equals the same vocabulary with the pre-tokenizer the
    original tokenizer.json of such models declares (llama.cpp's "default" has none: its regexes in sequence)."""
    folder, path = exported["qwen2" if pre == "qwen2" else "gpt-2"]
    tok = _load(tc.pre_variant(path, pre, tmp_path / f"{pre}.gguf", add_bos_token=False))
    pre_tok, ignore_merges = tc.reference_pre_tokenizers()[pre]
    ref = tc.with_pre_tokenizer(folder / "tokenizer.json", pre_tok, ignore_merges)
    assert _mismatches(tok, lambda t, a: ref.encode(t, add_special_tokens=a).ids, BPE_TEXTS) == []


def test_pre_tokenizers_split_differently(exported, tmp_path):
    folder, path = exported["gpt-2"]
    got = {}
    for pre in ("gpt-2", "llama-bpe", "default", "starcoder", "qwen2"):
        tok = _load(tc.pre_variant(path, pre, tmp_path / f"{pre}.gguf"))
        got[pre] = [w for w, _ in tok.backend.pre_tokenizer.pre_tokenize_str("x 12345 it'S !!?  \n\nend")]
    assert len({tuple(v) for v in got.values()}) == 5  # five regex sets, five splits of this text
    assert got["qwen2"][:7] == ["x", "Ġ", "1", "2", "3", "4", "5"] and got["llama-bpe"][2:4] == ["123", "45"]


def test_llama3_adds_bos_by_default_and_flags_win(exported, tmp_path):
    _, path = exported["gpt-2"]
    tok = _load(tc.pre_variant(path, "llama-bpe", tmp_path / "a.gguf", add_bos_token=None))
    assert tok.encode("hi")[0] == tok.bos_token_id == 0 and tok.encode("hi", add_special_tokens=False)[0] != 0
    tok = _load(tc.pre_variant(path, "llama-bpe", tmp_path / "b.gguf", add_bos_token=False, add_eos_token=True))
    assert tok.encode("hi")[0] != 0 and tok.encode("hi")[-1] == tok.eos_token_id == 2
    assert tok.encode("") == [2] and tok.encode("", add_special_tokens=False) == []


def test_end_of_generation_texts_are_control_whatever_the_file_says(exported):
    """llama.cpp retypes `<|im_end|>` and friends as CONTROL, so they are matched whole even when typed NORMAL."""
    _, path = exported["gpt-2"]
    md = tc.gguf_metadata(path)
    im_end = md["tokenizer.ggml.tokens"].index("<|im_end|>")
    md["tokenizer.ggml.token_type"][im_end] = 1
    tok = tokenizer_from_gguf(md, "x.gguf")
    assert tok.encode("a<|im_end|>b", add_special_tokens=False)[1] == im_end
    im_start = md["tokenizer.ggml.tokens"].index("<|im_start|>")
    md["tokenizer.ggml.token_type"][im_start] = 1  # not a name llama.cpp knows: an ordinary string again
    assert im_start not in tokenizer_from_gguf(md, "x.gguf").encode("<|im_start|>")


def test_longest_special_wins_over_a_prefix(exported):
    _, path = exported["gpt-2"]
    md = tc.gguf_metadata(path)
    md["tokenizer.ggml.tokens"].append("<|im")  # a user-defined prefix of <|im_end|>
    md["tokenizer.ggml.token_type"].append(4)
    tok = tokenizer_from_gguf(md, "x.gguf")
    assert tok.encode("<|im<|im_end|>", add_special_tokens=False) == [1024, 2]


# ---- SentencePiece BPE ("llama") -----------------------------------------------------------------------------------
def test_spm_encodes_as_tokenizer_json(spm):
    path, hf = spm
    tok = _load(path)
    assert _mismatches(tok, lambda t, a: hf.encode(t, add_special_tokens=a).ids, SPM_TEXTS) == []
    assert _mismatches(tok, lambda t, a: hf.encode(t, add_special_tokens=a).ids, SPM_TEXTS, False) == []
    assert tok.encode("Hello")[0] == tok.bos_token_id == 1 and tok.eos_token_id == 2


def test_lone_surrogates_are_refused_by_both_kinds(exported, spm):
    # the BPE path raised a TypeError from the tokenizers backend; the SentencePiece path encoded the bytes ED A0 80
    for path in (exported["qwen2"][1], spm[0]):
        with pytest.raises(RequestError, match="prompt is not valid text: character 1 is U\\+D800"):
            _load(path).encode("a\ud800b")


def test_spm_rules(spm):
    tok = _load(spm[0])
    ids = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    byte = lambda b: tok.token_to_id(f"<0x{b:02X}>")  # noqa: E731
    assert ids("ꙮ") == [tok.token_to_id("\u2581"), *(byte(b) for b in "ꙮ".encode())]  # unknown char: its bytes
    # a space is prefixed at the start and after every special token, as llama.cpp does
    assert ids("x<s>y") == [tok.token_to_id("\u2581x"), 1, tok.token_to_id("\u2581y")]
    assert ids(" ") == [tok.token_to_id("\u2581")] * 2
    assert tok.encode("") == [1] and ids("") == []


def test_phi3_specials_swallow_the_whitespace_after_them(spm):
    """llama.cpp knows Phi-3 by general.name; its specials but <unk> <s> <|endoftext|> strip the spaces after them."""
    md = tc.gguf_metadata(spm[0])
    plain = tokenizer_from_gguf(md, "s.gguf")
    phi3 = tokenizer_from_gguf({**md, "general.name": "Phi-3 mini"}, "s.gguf")
    assert phi3.encode("x</s> \n\t y", False) == phi3.encode("x</s>y", False) == plain.encode("x</s>y", False)
    assert phi3.encode("x<think>  y", False) == plain.encode("x<think>y", False)
    assert plain.encode("x</s> y", False) != plain.encode("x</s>y", False)
    assert phi3.encode("x<s> y", False) == plain.encode("x<s> y", False) != plain.encode("x<s>y", False)


def test_spm_decode(spm):
    tok = _load(spm[0])
    for text in SPM_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        # lossless but for U+2581 (reads back as a space), <unk> and the space prefixed after a special token
        if "\u2581" not in text and not any(s in text for s in (*tc.SPM_CONTROL, *tc.SPM_USER_DEFINED)):
            assert tok.decode(ids, skip_special_tokens=False) == text
        pieces = tok.stream_decoder()
        assert "".join(pieces.add(i) for i in ids) + pieces.flush() == tok.decode(ids)
    assert tok.decode(tok.encode("Hello world")) == " Hello world"  # after bos llama.cpp keeps the prefix space
    assert tok.decode(tok.encode("Hello world", add_special_tokens=False)) == "Hello world"
    assert tok.decode(tok.encode("<s>a</s>", add_special_tokens=False), skip_special_tokens=False) == "<s> a</s>"


def test_spm_matches_transformers_where_transformers_follows_llama_cpp(spm):
    """transformers' GGUF Llama tokenizer prefixes a space only at the very start, and not to text that starts
    with whitespace or U+2581; llama.cpp prefixes one after every special token and always at the start. On text
    without those, the two agree."""
    path, _ = spm
    tok = _load(path)
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    plain = [t for t in SPM_TEXTS if t and not t[0].isspace() and t[0] != "\u2581"
             and not any(s in t for s in (*tc.SPM_CONTROL, *tc.SPM_USER_DEFINED))]
    assert len(plain) > 150
    assert _mismatches(tok, lambda t, a: hf.encode(t, add_special_tokens=a), plain) == []
    assert tok.encode(" x") != hf.encode(" x")


# ---- metadata ------------------------------------------------------------------------------------------------------
def test_chat_templates_default_and_named(exported):
    _, path = exported["gpt-2"]
    md = tc.gguf_metadata(path)
    md.update({"tokenizer.chat_templates": ["tool_use"], "tokenizer.chat_template.tool_use": "T{{ tools }}"})
    tok = tokenizer_from_gguf(md, "x.gguf")
    assert set(tok.chat_template) == {"default", "tool_use"}
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tools=[{"a": 1}]) == "T[{'a': 1}]"
    assert tok.apply_chat_template(msgs).startswith("<|im_start|>user\nhi<|im_end|>")


def _breakers():
    """(description, mutation of a valid metadata dict, the key the error must name)."""
    def drop(key):
        return lambda md: md.pop(key)

    def put(key, value):
        return lambda md: md.__setitem__(key, value)

    def edit(key, f):
        return lambda md: md.__setitem__(key, f(md[key]))

    return [
        ("no model", drop("tokenizer.ggml.model"), "tokenizer.ggml.model"),
        ("no tokens", drop("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens"),
        ("no merges", drop("tokenizer.ggml.merges"), "tokenizer.ggml.merges"),
        ("tokens not a list", put("tokenizer.ggml.tokens", "abc"), "tokenizer.ggml.tokens"),
        ("empty vocabulary", put("tokenizer.ggml.tokens", []), "tokenizer.ggml.tokens"),
        ("a token not a string", edit("tokenizer.ggml.tokens", lambda v: v[:5] + [7] + v[6:]), "tokenizer.ggml.tokens"),
        ("duplicate token", edit("tokenizer.ggml.tokens", lambda v: v[:5] + [v[4]] + v[6:]), "tokenizer.ggml.tokens"),
        ("types too short", edit("tokenizer.ggml.token_type", lambda v: v[:-1]), "tokenizer.ggml.token_type"),
        ("a type not an int", edit("tokenizer.ggml.token_type", lambda v: ["1"] + v[1:]),
         "tokenizer.ggml.token_type"),
        ("merge of unknown tokens", edit("tokenizer.ggml.merges", lambda v: v + ["zzq qzz"]), "tokenizer.ggml.merges"),
        ("merge result unknown", edit("tokenizer.ggml.merges", lambda v: v + ["Ġ !"]), "tokenizer.ggml.merges"),
        ("merge without space", edit("tokenizer.ggml.merges", lambda v: ["ab"] + v), "tokenizer.ggml.merges"),
        ("eos out of range", put("tokenizer.ggml.eos_token_id", 10**6), "tokenizer.ggml.eos_token_id"),
        ("bos not an int", put("tokenizer.ggml.bos_token_id", "1"), "tokenizer.ggml.bos_token_id"),
        ("add_bos not a bool", put("tokenizer.ggml.add_bos_token", 1), "tokenizer.ggml.add_bos_token"),
        ("add_bos without bos", lambda md: (md.pop("tokenizer.ggml.bos_token_id"),
                                            md.__setitem__("tokenizer.ggml.add_bos_token", True)),
         "tokenizer.ggml.add_bos_token"),
        ("template not a string", put("tokenizer.chat_template", ["x"]), "tokenizer.chat_template"),
        ("named template missing", put("tokenizer.chat_templates", ["rag"]), "tokenizer.chat_template.rag"),
    ]


@pytest.mark.parametrize("what,mutate,key", _breakers(), ids=[b[0] for b in _breakers()])
def test_malformed_metadata_names_the_key_and_file(exported, what, mutate, key):
    md = copy.deepcopy(tc.gguf_metadata(exported["gpt-2"][1]))
    mutate(md)
    with pytest.raises(CheckpointError) as e:
        tokenizer_from_gguf(md, "/models/broken.gguf")
    assert e.value.file == "/models/broken.gguf" and key in str(e.value), str(e.value)


def test_malformed_spm_scores(spm):
    md = tc.gguf_metadata(spm[0])
    md["tokenizer.ggml.scores"] = md["tokenizer.ggml.scores"][:-3]
    with pytest.raises(CheckpointError, match="tokenizer.ggml.scores: holds"):
        tokenizer_from_gguf(md, "s.gguf")
    md["tokenizer.ggml.scores"] = ["x"] * len(md["tokenizer.ggml.tokens"])
    with pytest.raises(CheckpointError, match="tokenizer.ggml.scores: element 0"):
        tokenizer_from_gguf(md, "s.gguf")


def test_unknown_model_or_pre_tokenizer_is_a_config_error(exported):
    md = tc.gguf_metadata(exported["gpt-2"][1])
    md["tokenizer.ggml.pre"] = "tekken"
    with pytest.raises(ConfigError, match=r"'tekken'.*known: .*llama-bpe.*qwen2"):
        tokenizer_from_gguf(md, "x.gguf")
    md["tokenizer.ggml.model"] = "bert"
    with pytest.raises(ConfigError, match=r"'bert' is not supported; sluice reads gpt2, llama"):
        tokenizer_from_gguf(md, "x.gguf")


def test_missing_pre_tokenizer_means_default(exported):
    md = tc.gguf_metadata(exported["gpt-2"][1])
    del md["tokenizer.ggml.pre"]
    assert tokenizer_from_gguf(md, "x.gguf").vocab.pre == "default"
