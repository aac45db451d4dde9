"""Train a tiny byte-level BPE tokenizer offline, written as a Hugging Face model folder's tokenizer files.

Tests and `make-model` need a real tokenizer without a model hub. The default corpus is the docstrings of a fixed
list of standard-library modules: always present, deterministic for a given Python, and English prose plus code.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from sluice.errors import ConfigError

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Qwen-style ChatML: one `<|im_start|>role\ncontent<|im_end|>\n` block per message.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Cheap to import, no side effects, pure-Python docstrings in the main. Order is fixed: it is the corpus order.
_CORPUS_MODULES = (
    "textwrap", "string", "json", "collections", "functools", "itertools", "pathlib", "re", "random",
    "statistics", "datetime", "calendar", "argparse", "logging", "difflib", "heapq", "bisect", "fractions",
    "decimal", "shutil", "tempfile", "csv", "typing", "dataclasses", "enum", "contextlib", "inspect",
    "pydoc", "unittest", "email", "http.client", "urllib.parse", "zipfile", "tarfile", "subprocess",
)
# A few hundred KB trains in well under a second; more only slows tests down.
_MAX_CORPUS_CHARS = 300_000


def default_corpus(max_chars: int = _MAX_CORPUS_CHARS) -> list[str]:
    """Docstrings of a fixed list of stdlib modules (and their public members), in a deterministic order.

    Under `python -OO` docstrings are stripped, so the modules' source text is used instead.
    """
    texts: list[str] = []
    total = 0
    with warnings.catch_warnings():  # getattr on deprecated aliases (typing.io, ...) warns; the text is still fine
        warnings.simplefilter("ignore")
        for text in _stdlib_texts(use_source=sys.flags.optimize >= 2):
            texts.append(text)
            total += len(text)
            if total >= max_chars:
                break
    return texts


def _stdlib_texts(use_source: bool) -> Iterator[str]:
    for name in _CORPUS_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a trimmed Python build; the corpus just gets shorter
            continue
        if use_source:
            try:
                yield inspect.getsource(module)
            except (OSError, TypeError):
                pass
            continue
        doc = inspect.getdoc(module)
        if doc:
            yield doc
        for attr in sorted(dir(module)):
            if attr.startswith("_"):
                continue
            obj = getattr(module, attr, None)
            if getattr(obj, "__module__", None) != module.__name__:
                continue  # re-exports would repeat other modules' text
            doc = inspect.getdoc(obj)
            if doc:
                yield doc


# The trainer allocates ~70 bytes per requested token up front and aborts the process (a Rust allocation failure, no
# exception) when it cannot: 10^9 asked for 70 GB. Released vocabularies reach 262,144 (Gemma 3).
MAX_VOCAB = 2**20


def train_tokenizer(out_dir: str | Path, vocab_size: int = 1024, texts: Iterable[str] | None = None,
                    special_tokens: Sequence[str] = ()) -> Path:
    """Train a byte-level BPE tokenizer and write `tokenizer.json` + `tokenizer_config.json` into `out_dir`.

    The folder loads with both `sluice.tokenizer.Tokenizer.from_folder` and transformers' `AutoTokenizer`.
    Special tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` get ids 0, 1, 2, then `special_tokens` (a family's
    own, which its converters look up by name: GLM's `[gMASK]`, `<|user|>`, ...) the ids after them; eos is
    `<|im_end|>` and the chat template is ChatML. The same inputs give byte-identical files. Returns `out_dir` as a
    Path.
    """
    if not 1 <= vocab_size <= MAX_VOCAB:
        raise ConfigError(f"vocab_size: the tokenizer is trained with at most {MAX_VOCAB:,} tokens (4x the largest "
                          f"vocabularies in use), got {vocab_size:,}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = list(texts) if texts is not None else default_corpus()

    tok = Tokenizer(models.BPE(unk_token=None))
    # The GPT-2 / Qwen layout: NFC, regex split + bytes-to-unicode, so every string encodes without <unk>.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[*SPECIAL_TOKENS, *(t for t in special_tokens if t not in SPECIAL_TOKENS)],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    tok.save(str(out / "tokenizer.json"))

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "chat_template": CHATML_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", "utf-8")
    return out
