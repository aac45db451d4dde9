"""Texts and GGUF tokenizer files for checking `tokenizer_from_gguf` against tokenizer.json, transformers and
llama.cpp (tests/test_tokenizer_gguf.py; benchmarks/tokenizer_llamacpp.py runs the same files through llama.cpp).

Vocabularies are trained here with `tokenizers` on the stdlib-docstring corpus; nothing is downloaded.
"""

from __future__ import annotations

import json
import random
import shutil
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import trainers

from sluice.tools.tokenizer_train import CHATML_TEMPLATE, default_corpus

# Hand-picked: each line aims at one rule of the splitters, the special-token partition or the byte fallback.
HAND_TEXTS = [
    "", " ", "  ", "\n", "\n\n", "\r\n", "\t", " \t \n ", "a", "Hello, world!", "Hello world", " Hello world",
    "  Hello   world  ", "hello\nworld", "hello\n\n\nworld", "line one\r\nline two\r\n", "tab\tseparated\tvalues",
    "trailing spaces   ", "   leading spaces", "a  b   c    d", "x \n y", " \n\n x", "\n \n", "end.\n",
    "it's I'm you're we've they'll he'd don't", "IT'S I'M YOU'RE WE'VE THEY'LL HE'D", "'s 't 're 've 'm 'll 'd",
    "rock'n'roll", "''quoted''", "the cat's ſ 'ſ", "1", "12", "123", "1234", "12345678901234567890", "3.14159",
    "1,000,000", "v2.0.1-beta", "2024-01-31T12:00:00Z", "0x1F 0b1010 1e-9", "١٢٣٤٥ ۱۲۳ ১২৩ ๑๒๓", "½ ¾ ² ³ Ⅻ ⅷ",
    "naïve café — déjà vu, Ünïcödé", unicodedata.normalize("NFD", "naïve café déjà"), "e\u0301 a\u0308 o\u0303",
    "\u0301\u0301 leading marks", "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319algo",
    "日本語のテキストと中文", "你好，世界！这是一个测试。", "한국어 텍스트 입니다", "カタカナ ひらがな 漢字",
    "Привет, мир! Съешь ещё этих мягких", "Γειά σου κόσμε", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया",
    "สวัสดีชาวโลก", "Xin chào thế giới", "Ελληνικά και English mixed 混合",
    "emoji 🎉👩‍👩‍👧 flags 🇫🇷🇯🇵 skin 👋🏽 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "🙂", "🙂🙂🙂", " 🙂", "a🙂b", "❤️ ✨ ⭐",
    "math ∑∫∂√∞ ≤≥≠ → ⇒ ∀x∈ℝ", "fullwidth ＡＢＣ１２３！", "nbsp\u00a0here", "ideographic\u3000space",
    "line\u2028separator\u2029para", "next\u0085line", "zero\u200bwidth\u200cjoiners\u200d", "\ufeffBOM at start",
    "ctrl \x00 \x01 \x1b[31mred\x1b[0m \x7f", "private \ue000\uf8ff", "unassigned \u0378\u0379 \U000e0001 tag",
    "def f(x):\n    return x ** 2  # squared\n", "if (a && b) { return c || d; }", "for i in range(10):\n\tpass",
    '{"key": "value", "n": [1, 2, 3], "ok": true}', "https://example.com/path?q=1&r=two#frag", "user@example.org",
    "<html><body class=\"x\">text</body></html>", "$ ls -la | grep '^d' > out.txt", "C:\\Users\\name\\file.txt",
    "!!!???...,,,;;;:::", "-- -- --- ---- ___ *** ###", "(((nested))) [[brackets]] {{braces}}", "a.b.c,d;e:f",
    "\u2581already\u2581escaped \u2581", "Ġliteral Ġbyte Ċchars", "<0x0A> <0xFF> literal byte names",
    "<s> literal bos </s> and <unk>", "<s><s></s>", "x<s>y", "[INST] question [/INST] answer",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n", "text<|endoftext|>more text<|im_end|>",
    "<|im_start|><|im_end|><|endoftext|>", "<|im_start|", "|im_end|>", "<|im_end|<|im_end|>>", "<<|im_end|>>",
    " <|im_end|> ", "<|im_end|>\n\n<|im_end|>", "<think>\nreasoning\n</think>\nanswer", "<think><think>",
    "a" * 300, "ab" * 150, " " * 40 + "x", "\n" * 12, "word " * 60,
]

_PIECES = {
    "space": [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\u00a0", "\u3000", "\u2009"],
    "digit": ["0", "7", "42", "123", "2024", "99999", "3.5", "1,234", "٣", "²"],
    "punct": [".", ",", "!", "?", "'", '"', "-", "--", "(", ")", "[", "]", "{", "}", ":", ";", "...", "'s", "'LL",
              "#", "@", "$", "%", "^", "&", "*", "+", "=", "<", ">", "|", "~", "`", "/", "\\", "_", "—", "«", "»"],
    "emoji": ["🎉", "👩‍👩‍👧", "🇫🇷", "👋🏽", "🙂", "❤️", "🚀", "𝔘"],
    "cjk": ["日本", "語", "中文", "测试", "한국어", "カタ", "ひら"],
    "mark": ["\u0301", "\u0308", "\u0303", "\u0327", "\u094d", "\u0e31"],
    "accented": ["é", "ü", "ñ", "ø", "ç", "Ω", "ж", "ß", "İ", "ǅ"],
}


def random_texts(n: int, specials: Sequence[str] = (), seed: int = 0) -> list[str]:
    """`n` texts mixing corpus words, whitespace runs, digits, punctuation, emoji, CJK, combining marks and the
    given special tokens, drawn with a fixed seed."""
    rng = random.Random(seed)
    words = " ".join(default_corpus(60_000)).split()
    kinds = [*_PIECES, "word", "word", "word", "Word", "special"]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 24)):
            kind = rng.choice(kinds)
            if kind == "word":
                parts.append(rng.choice(words))
            elif kind == "Word":
                parts.append(rng.choice(words).upper())
            elif kind == "special":
                parts.append(rng.choice(list(specials) or [" "]))
            else:
                parts.append(rng.choice(_PIECES[kind]))
            if rng.random() < 0.5:
                parts.append(" ")
        out.append("".join(parts))
    return out


def texts(specials: Sequence[str] = (), n_random: int = 240, seed: int = 0) -> list[str]:
    """The hand-picked texts, then `n_random` random ones."""
    return HAND_TEXTS + random_texts(n_random, specials, seed)


# ---- GGUF files ----------------------------------------------------------------------------------------------------
def gguf_metadata(path: str | Path) -> dict[str, Any]:
    """A GGUF's metadata as the GGUF reader hands it to tokenizer_from_gguf: key -> value, arrays as lists."""
    import gguf

    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}


def write_vocab_gguf(path: str | Path, kv: dict[str, Any]) -> Path:
    """A tensor-less GGUF (arch llama, tiny hyper-parameters llama.cpp's vocab_only load accepts) holding the
    tokenizer keys `kv` (`tokenizer.*` key -> value; lists of str/int/float/bool become arrays)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(16)
    for key, value in kv.items():
        if key == "tokenizer.ggml.token_type":
            w.add_array(key, [int(v) for v in value])
        elif key == "tokenizer.ggml.scores":
            w.add_array(key, [float(v) for v in value])
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return Path(path)


def tokenizer_kv(path: str | Path) -> dict[str, Any]:
    """The `tokenizer.*` metadata of a GGUF."""
    return {k: v for k, v in gguf_metadata(path).items() if k.startswith("tokenizer.")}


# ---- byte-level BPE ------------------------------------------------------------------------------------------------
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
               r"\s+(?!\S)|\s+")  # Qwen2/Qwen3's tokenizer.json, exactly
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")  # Qwen3.5's tokenizer.json, exactly
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")  # Llama 3's tokenizer.json, exactly
BPE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def qwen2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def train_qwen2_tokenizer(out_dir: str | Path, vocab_size: int = 1024) -> Path:
    """A Qwen2-style folder (NFC, Qwen's split regex + byte level, ChatML specials and template, `<think>` as a
    plain added token) whose tokenizer.json `sluice export-gguf` writes as pre-tokenizer "qwen2"."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = qwen2_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(BPE_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = default_corpus()
    tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "bos_token": None,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
              "clean_up_tokenization_spaces": False, "chat_template": CHATML_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), "utf-8")
    return out


def with_pre_tokenizer(tokenizer_json: str | Path, pre: pre_tokenizers.PreTokenizer | None,
                       ignore_merges: bool = False) -> Tokenizer:
    """The tokenizer of `tokenizer_json` with its normalizer dropped (llama.cpp has none) and `pre` instead of its
    pre-tokenizer: the reference for a GGUF that pairs this vocabulary with another `tokenizer.ggml.pre`."""
    data = json.loads(Path(tokenizer_json).read_text("utf-8"))
    data["normalizer"] = None
    data["model"]["ignore_merges"] = ignore_merges
    tok = Tokenizer.from_str(json.dumps(data))
    if pre is not None:
        tok.pre_tokenizer = pre
    return tok


def reference_pre_tokenizers() -> dict[str, tuple[pre_tokenizers.PreTokenizer, bool]]:
    """`tokenizer.ggml.pre` -> (the pre-tokenizer the original Hugging Face tokenizer.json of such models declares,
    ignore_merges). "default" has no such model; its reference is llama.cpp's four regexes in sequence."""
    split = lambda r: pre_tokenizers.Split(Regex(r), behavior="isolated")  # noqa: E731
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
    return {
        "gpt-2": (pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False),
        "olmo": (pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False),  # GPT-NeoX's
        "qwen2": (qwen2_pre_tokenizer(), False),
        "qwen35": (pre_tokenizers.Sequence([split(QWEN35_SPLIT), byte_level]), False),
        "llama-bpe": (pre_tokenizers.Sequence([split(LLAMA3_SPLIT), byte_level]), True),
        "starcoder": (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
                      False),
        "default": (pre_tokenizers.Sequence([split(r"[\p{P}\$\+<=>\^~\|]+"), split(gpt2), split(r"\p{N}+"),
                                             split(r"[0-9][0-9][0-9]"), byte_level]), False),
    }


# ---- SentencePiece BPE ("llama") -----------------------------------------------------------------------------------
SPM_CONTROL = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 as in Llama / Mixtral
SPM_USER_DEFINED = ("<think>",)


def spm_vocab(vocab_size: int = 800) -> tuple[dict[str, Any], Tokenizer]:
    """A Mixtral-shaped SentencePiece BPE vocabulary trained here: (GGUF `tokenizer.*` metadata, the Hugging Face
    tokenizer.json equivalent).

    Ids: <unk> <s> </s>, then the 256 byte tokens <0x00>..<0xFF>, then `<think>` (user-defined), then the learned
    pieces. A piece's score is minus its rank (a merge's result scores by the merge's rank, single characters
    below every merge), which is how SentencePiece BPE orders pieces.
    """
    trainer_tok = Tokenizer(models.BPE(unk_token=None))
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False, limit_alphabet=200)
    corpus = default_corpus()
    trainer_tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    learned = json.loads(trainer_tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    merged = {a + b for a, b in merges}
    chars = [t for t, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]) if t not in merged]

    head = [*SPM_CONTROL, *(f"<0x{b:02X}>" for b in range(256)), *SPM_USER_DEFINED]
    pieces = [p for p in [a + b for a, b in merges] + chars if p not in head]
    tokens = head + pieces
    types = [2, 3, 3] + [6] * 256 + [4] * len(SPM_USER_DEFINED) + [1] * len(pieces)
    scores = [0.0] * len(head) + [-float(i) for i in range(len(pieces))]
    kv = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
          "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
          "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True,
          "tokenizer.ggml.add_eos_token": False,
          "tokenizer.chat_template": "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}"
                                     "{{ '[INST] ' + m.content + ' [/INST]' }}{% else %}{{ m.content + eos_token }}"
                                     "{% endif %}{% endfor %}"}

    ids = {t: i for i, t in enumerate(tokens)}
    hf = Tokenizer(models.BPE(vocab=ids, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPM_CONTROL])
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in SPM_USER_DEFINED])
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                      special_tokens=[("<s>", 1)])
    return kv, hf


# ---- the files the tests and the llama.cpp benchmark share -------------------------------------------------------
def exported_bpe_files(root: str | Path) -> dict[str, tuple[Path, Path]]:
    """Two tiny qwen3_moe models written by `sluice export-gguf`: pre name -> (model folder, GGUF). "gpt-2": the
    ChatML byte-level tokenizer `make-model` trains; "qwen2": a Qwen2-style tokenizer (with `<think>` as a
    user-defined token) and a config vocabulary wider than the tokenizer, so ids 1024..1039 are [PAD<id>]."""
    from sluice.tools.gguf_export import export_gguf
    from sluice.tools.synth import SynthConfig, make_model

    root = Path(root)
    tiny = SynthConfig(arch="qwen3_moe", hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                       num_experts=2, top_k=1, moe_intermediate_size=32, vocab_size=1024, dtype="bfloat16")
    gpt2 = make_model(root / "gpt2", tiny, progress=False, force=True)
    qwen = root / "qwen2"
    shutil.rmtree(qwen, ignore_errors=True)
    shutil.copytree(gpt2, qwen)
    train_qwen2_tokenizer(qwen)
    cfg = json.loads((qwen / "config.json").read_text())
    cfg["vocab_size"] = 1040
    (qwen / "config.json").write_text(json.dumps(cfg))
    out = {}
    for name, folder in (("gpt-2", gpt2), ("qwen2", qwen)):
        path = root / f"{name}.gguf"
        export_gguf(folder, path, "bf16")
        out[name] = (folder, path)
    return out


def pre_variant(path: str | Path, pre: str, out: str | Path, **changes: Any) -> Path:
    """A tensor-less copy of the GGUF at `path`'s tokenizer with `tokenizer.ggml.pre` = `pre` and other
    `tokenizer.ggml.<key>` values changed (None drops the key)."""
    kv = tokenizer_kv(path)
    kv["tokenizer.ggml.pre"] = pre
    for key, value in changes.items():
        if value is None:
            kv.pop(f"tokenizer.ggml.{key}", None)
        else:
            kv[f"tokenizer.ggml.{key}"] = value
    return write_vocab_gguf(out, kv)
