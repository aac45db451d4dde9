"""Tokenizer, chat template, streaming detokenizer and stop strings for a Hugging Face model folder.

Encoding and decoding are `tokenizers` (the Rust library transformers' fast tokenizers wrap), so ids match
`AutoTokenizer`. Chat templates render with jinja2 in the same sandboxed environment transformers builds
(`transformers/utils/chat_template_utils.py`), so prompts match `apply_chat_template(..., tokenize=False)`, with
bounds on the size, work and steps of a rendering (template.py): a template that fails or runs away is one
RequestError naming it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend

from sluice.checkpoint.jsonfile import read_json
from sluice.errors import CheckpointError, RequestError
from sluice.tokenizer.template import Limits, TemplateLimitError, error_line, render

# The named special tokens transformers exposes to templates as `bos_token`, `eos_token`, ... (in this order).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
ROLES = ("system", "user", "assistant", "tool")
# Names a message's reasoning travels under; templates read `reasoning_content` (most) or `thinking` (gpt-oss).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_SURROGATE = re.compile("[\ud800-\udfff]")


def text_problem(text: str) -> str | None:
    """Why `text` cannot be encoded, or None: a lone surrogate (U+D800-U+DFFF), which no UTF-8 tokenizer can encode.

    They come from bytes that are not UTF-8 (Python decodes argv and, with surrogateescape, files and stdin to
    U+DC80-U+DCFF) or from a JSON string with half of a `\\u` surrogate pair (or its bytes, ED A0 80 for U+D800, which
    json.loads lets through). Found without copying the text.
    """
    m = _SURROGATE.search(text)
    if m is None:
        return None
    cp = ord(m.group())
    byte = f"the byte 0x{cp - 0xDC00:02X} of input that is not UTF-8, or " if 0xDC80 <= cp <= 0xDCFF else ""
    return (f"not valid text: character {m.start()} is U+{cp:04X}, a lone surrogate ({byte}half of a UTF-16 "
            "surrogate pair); send UTF-8 text")


def check_text(text: str, what: str = "prompt") -> None:
    """Raise RequestError naming `what` if `text` holds a lone surrogate (see text_problem)."""
    problem = text_problem(text)
    if problem is not None:
        raise RequestError(f"{what} is {problem}")


class Tokenizer:
    """A model folder's tokenizer: `tokenizer.json` + `tokenizer_config.json` (+ `chat_template.jinja`)."""

    def __init__(
        self,
        backend: _Backend,
        config: Mapping[str, Any] | None = None,
        chat_template: str | dict[str, str] | None = None,
        source: str = "<memory>",
    ):
        config = dict(config or {})
        self.backend = backend
        self.source = source  # the folder, named in errors
        self.special_tokens: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            token = _token_content(config.get(name), name, source)
            if token is not None:
                self.special_tokens[name] = token
        # transformers adds named special tokens missing from tokenizer.json's vocab; do the same so ids agree.
        missing = [t for t in self.special_tokens.values() if backend.token_to_id(t) is None]
        if missing:
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(missing)])
        # Read for callers, but encode() does not act on it: since transformers 5 the tokenizer.json post-processor
        # alone decides which specials `add_special_tokens=True` adds, and matching AutoTokenizer is the contract.
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.chat_template = chat_template

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json`, `tokenizer_config.json` and an optional `chat_template.jinja` from a folder."""
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise CheckpointError("tokenizer.json not found; sluice needs the fast-tokenizer file", file=str(tok_file))
        try:
            backend = _Backend.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception for malformed JSON or unknown components
            raise CheckpointError(f"cannot load tokenizer: {e}", file=str(tok_file)) from e
        config: dict[str, Any] = {}
        cfg_file = folder / "tokenizer_config.json"
        if cfg_file.is_file():
            config = read_json(cfg_file)  # CheckpointError for bad JSON, deep nesting, huge numbers, surrogates
        return cls(backend, config, _load_chat_template(folder, config), source=str(folder))

    # ---- ids <-> text --------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; special tokens written in the text (e.g. `<|im_start|>`) become their ids."""
        check_text(text)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for `ids`; invalid UTF-8 byte sequences decode to U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (`len(AutoTokenizer(...))`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (e.g. `"<|im_end|>"`), or None if it is not in the vocabulary."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Token string of an id, or None if out of range."""
        return self.backend.id_to_token(token_id)

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A fresh incremental detokenizer over this tokenizer."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    # ---- chat ----------------------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str:
        """Render a conversation to the prompt text, exactly as transformers' `apply_chat_template(tokenize=False)`.

        `chat_template` may name one of the folder's templates or be a template string. `extra` keyword arguments
        reach the template (e.g. `enable_thinking=False`) and override the special tokens of the same name.
        Encode the result with `add_special_tokens=False`: templates write their own bos.
        """
        template, label = self._select_template(chat_template, tools)
        chat = _validate_messages(messages)
        if tools is not None and (
            not isinstance(tools, Sequence) or isinstance(tools, str) or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise RequestError("tools must be a list of JSON-schema objects (dicts)")
        documents = extra.pop("documents", None)
        kwargs = {**self.special_tokens, **extra}  # caller's values win, as in transformers
        variables = dict(messages=chat, tools=[dict(t) for t in tools] if tools is not None else None,
                         documents=documents, add_generation_prompt=add_generation_prompt, **kwargs)
        limits = Limits.for_input(variables, messages=len(chat))
        try:
            return render(template, limits, **variables)
        except jinja2.TemplateSyntaxError as e:
            if label == "the template passed as chat_template":
                raise RequestError(f"{label} is not valid jinja (line {e.lineno}): {e.message}") from e
            label = label.removesuffix(f" of model {self.source}")  # the file is named in front
            raise CheckpointError(f"{label} is not valid jinja (line {e.lineno}): {e.message}", file=self.source) from e
        except TemplateLimitError as e:  # a template that would run away with time or memory
            raise RequestError(f"{label}{_at(e)} was stopped: {e}") from None
        except RecursionError as e:
            raise RequestError(f"{label}{_at(e)} recursed too deeply (RecursionError)") from None
        except MemoryError:
            raise RequestError(f"{label} ran out of memory") from None
        except Exception as e:  # noqa: BLE001 - the template's own operations: TypeError, ZeroDivisionError, ...
            if type(e) is jinja2.TemplateError:  # raise_exception() in the template: it refuses this conversation
                raise RequestError(f"{label} rejected the messages{_at(e)}: {e}") from None
            what = " ".join(str(e).split())
            what = what if len(what) <= 300 else what[:300] + "..."
            raise RequestError(f"{label} failed{_at(e)}: {type(e).__name__}: {what}") from None

    def _select_template(self, name_or_template: str | None, tools: object) -> tuple[str, str]:
        """(the template, how errors name it)."""
        templates = self.chat_template
        passed = "the template passed as chat_template"
        if isinstance(templates, dict):
            if name_or_template is not None:
                if name_or_template in templates:
                    return templates[name_or_template], f"chat template {name_or_template!r} of model {self.source}"
                return name_or_template, passed
            for name in (["tool_use"] if tools is not None else []) + ["default"]:
                if name in templates:
                    return templates[name], f"chat template {name!r} of model {self.source}"
            raise RequestError(
                f"model {self.source} has several chat templates {sorted(templates)} and none named 'default'; "
                "pass chat_template=<name>"
            )
        if name_or_template is not None:
            return name_or_template, passed
        if templates is None:
            raise RequestError(
                f"model {self.source} has no chat template (none in tokenizer_config.json or chat_template.jinja); "
                "send a raw prompt instead, or pass chat_template=<jinja string>"
            )
        return templates, f"the chat template of model {self.source}"


def _at(e: BaseException) -> str:
    line = error_line(e)
    return "" if line is None else f" at line {line}"


def _token_content(value: object, name: str, source: str) -> str | None:
    # Special tokens appear as plain strings or as serialized AddedToken dicts {"content": ..., ...}.
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise CheckpointError(f"{name} must be a string or an object with 'content', got {value!r}",
                          file=str(Path(source) / "tokenizer_config.json"))


def _load_chat_template(folder: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The folder's chat template(s): `chat_template.jinja` (+ `additional_chat_templates/*.jinja`) win over
    `tokenizer_config.json["chat_template"]`, which is a string or a list of {name, template}."""
    templates: dict[str, str] = {}
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text("utf-8")
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            templates[f.stem] = f.read_text("utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates

    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    cfg_file = str(folder / "tokenizer_config.json")
    if isinstance(value, list):
        out: dict[str, str] = {}
        for item in value:
            if not (isinstance(item, Mapping) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                raise CheckpointError(f"chat_template list entries need string 'name' and 'template', got {item!r}",
                                      file=cfg_file)
            out[item["name"]] = item["template"]
        return out
    raise CheckpointError(f"chat_template must be a string or a list, got {type(value).__name__}", file=cfg_file)


def _validate_messages(messages: object) -> list[dict[str, Any]]:
    """Check roles and contents; return plain-dict copies with None-valued keys dropped (as transformers does:
    many templates render a missing key well and `content=None` as the text "None")."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise RequestError(f"messages must be a list of {{role, content}} objects, got {type(messages).__name__}")
    if not messages:
        raise RequestError("messages must hold at least one message")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise RequestError(f"messages[{i}] must be an object with role and content, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}")
        content = message.get("content")
        # An assistant turn that only calls tools carries no text.
        if not (isinstance(content, str) or (content is None and role == "assistant" and message.get("tool_calls"))):
            raise RequestError(f"messages[{i}].content must be a string; got {type(content).__name__}")
        m = {k: v for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        chat.append(m)
    return chat


# ---- streaming ------------------------------------------------------------------------------------------------------


class StreamDecoder:
    """Incremental detokenizer: `add(id)` returns the new text, and all pieces (plus `flush()`) concatenate to
    `decode(all ids)`.

    Decodes only a window: the ids of the last emitted piece (a prefix, so decoders that look at neighbours, like
    a leading-space strip, see context) and the ids not yet emitted. Text is held back while it ends in U+FFFD,
    i.e. while a multi-byte character is split across tokens.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: first id of the last emitted piece
        self._read = 0  # ids before this are emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Feed one id; return the text it completes ("" while a character is still partial)."""
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        new_text = self._decode(self.ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """At the end of generation: whatever was held back (an incomplete character decodes to U+FFFD)."""
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        new_text = self._decode(self.ids[self._prefix:])
        self._prefix, self._read = self._read, len(self.ids)
        return new_text[len(prefix_text):]


class StopMatcher:
    """Cuts generated text at the first stop string.

    `feed(piece)` returns `(text safe to emit now, stopped)`. Text before a stop is emitted, the stop is not. A
    suffix that could still grow into a stop string is held back until the next piece decides it; `flush()` hands
    it out when generation ends without a stop.
    """

    def __init__(self, stops: Sequence[str]):
        if isinstance(stops, str):
            stops = [stops]
        for i, s in enumerate(stops):
            if not isinstance(s, str) or not s:
                raise RequestError(f"stop[{i}] must be a non-empty string; got {s!r}")
        self.stops = list(dict.fromkeys(stops))
        self.matched: str | None = None  # the stop string that ended generation
        self._buf = ""

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add a piece of generated text; return the text now safe to emit and whether a stop string was hit."""
        if self.stopped:
            return "", True
        self._buf += piece
        hit, hit_at = None, len(self._buf)
        for s in self.stops:
            at = self._buf.find(s)
            if at != -1 and at < hit_at:  # the earliest stop in the text wins, whatever its order in the list
                hit, hit_at = s, at
        if hit is not None:
            self.matched = hit
            out, self._buf = self._buf[:hit_at], ""
            return out, True
        hold = self._partial_stop_len()
        out = self._buf[:len(self._buf) - hold]
        self._buf = self._buf[len(self._buf) - hold:]
        return out, False

    def _partial_stop_len(self) -> int:
        # Longest suffix of the buffer that is a proper prefix of some stop string.
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self._buf)), best, -1):
                if self._buf.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """Generation ended without a stop: release the held-back text."""
        out, self._buf = self._buf, ""
        return "" if self.stopped else out
