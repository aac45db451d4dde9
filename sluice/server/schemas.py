"""Request validation and OpenAI-shaped responses for the HTTP server.

Requests are pydantic models in strict mode: a string where a number belongs is a 400 naming the field, never a
silent coercion. Unknown fields are ignored, as OpenAI-compatible servers do, because clients send many optional
ones (`user`, `metadata`, ...); the ones that would change the result and that sluice cannot honour (n > 1,
logprobs, penalties, tools, JSON mode) are refused by name instead of being ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..sampling import SEED_MAX, SEED_MIN
from ..tokenizer import text_problem


class ApiError(Exception):
    """An error answered as OpenAI's error object `{"error": {"message", "type", "code", "param"}}`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers

    def body(self) -> dict:
        # a lone surrogate the client sent and a message echoes could not be written as UTF-8: escape it
        message = self.message.encode("utf-8", "backslashreplace").decode("utf-8")
        return {"error": {"message": message, "type": self.type, "code": self.code, "param": self.param}}


def parse_request(raw: bytes, model: type[BaseModel]) -> Any:
    """Decode a JSON body and validate it against `model`; every problem is a 400 ApiError naming the field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e
    except RecursionError as e:
        raise ApiError(400, "the request body nests arrays or objects too deeply to parse", code="invalid_json") from e
    except ValueError as e:  # int() of a number with more than sys.get_int_max_str_digits() digits
        why = str(e).split(";")[0]  # (without Python's advice to raise the interpreter's limit)
        raise ApiError(400, f"the request body holds a number too long to read: {why}", code="invalid_json") from e
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = _param(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        more = f" (and {e.error_count() - 1} more problems)" if e.error_count() > 1 else ""
        code = "missing_required_parameter" if err["type"] == "missing" else "invalid_value"
        raise ApiError(400, f"{param}: {msg}{more}" if param else msg + more, code=code, param=param or None) from e


def _text(v: str) -> str:
    """A string the model will read: one with a lone surrogate (`\\ud800`, or the bytes ED A0 80) is refused here,
    where the error can name the field."""
    problem = text_problem(v)
    if problem is not None:
        raise ValueError(problem)
    return v


def _param(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ChatMessage(_Strict):
    # "developer" is OpenAI's newer name for system instructions; templates know "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v: Any) -> str | None:
        """Content is a string or a list of text parts (joined); images and audio cannot be fed to a text model."""
        if v is None or isinstance(v, str):
            return v if v is None else _text(v)
        if isinstance(v, list):
            texts = []
            for i, part in enumerate(v):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ValueError(f"part {i} is not a text part; only {{'type': 'text', 'text': ...}} is supported")
                texts.append(part["text"])
            return _text("".join(texts))
        raise ValueError(f"must be a string or a list of text parts, got {type(v).__name__}")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        return v if v is None else _text(v)

    def to_template(self) -> dict[str, Any]:
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        return out


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    # Not in OpenAI's schema; vLLM and llama.cpp accept them the same way.
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, lt=1)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)  # what torch's generator takes: 64 bits
    stop: Any = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Any) -> list[str]:
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("must be a non-empty string or a list of non-empty strings")
        if len(stops) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(stops)}")
        for i, stop in enumerate(stops):
            if (problem := text_problem(stop)) is not None:  # it could never match the text generated
                raise ValueError(f"stop[{i}] is {problem}")
        return stops

    @field_validator("n")
    @classmethod
    def _one(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only n=1 is supported (one choice per request)")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None) -> float | None:
        if v:
            raise ValueError("not supported (use repetition_penalty); send 0 or leave it out")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("not supported")
        return v

    def sampling(self) -> dict[str, Any]:
        """Keyword arguments for `Model.generate`, with sluice's defaults for what the request left out."""
        out: dict[str, Any] = {"temperature": 1.0 if self.temperature is None else self.temperature}
        for name in ("top_p", "top_k", "min_p", "repetition_penalty", "seed"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Sampling):
    # fail_fast: only the first error is reported, and a million bad messages must not build a million errors
    # (measured: 1.3M empty objects in 3.7 MB took 36 s and 1.8 GB to report)
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    response_format: dict | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v: int | None) -> int | None:
        # it was ignored; OpenAI refuses it without logprobs=true, which sluice does not support
        if v is not None:
            raise ValueError("needs logprobs=true, and logprobs are not supported; leave it out")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list | None) -> list | None:
        if v:
            raise ValueError("tool calling is not supported")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict | None) -> dict | None:
        if v is not None and v.get("type") != "text":
            raise ValueError("only {'type': 'text'} is supported (no JSON mode)")
        return v

    def limit(self) -> int | None:
        """max_completion_tokens (the newer name) wins over max_tokens when both are sent."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def limit_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class CompletionRequest(_Sampling):
    prompt: Any
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        """One prompt: a string, a list holding one string, or a list of token ids."""
        if isinstance(v, str):
            return _text(v)
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
            return _text(v[0])
        if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return v
        raise ValueError("must be a string or a list of token ids (one prompt per request)")

    @field_validator("echo", "logprobs", "suffix")
    @classmethod
    def _unsupported(cls, v: Any) -> Any:
        if v:
            raise ValueError("not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return v

    def limit(self) -> int | None:
        return self.max_tokens

    def limit_param(self) -> str:
        return "max_tokens"


# ---- responses ------------------------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class Reply:
    """The response objects of one request, a chat completion (`chat`) or a text completion: whole, or as the
    chunks of a stream (an opening chunk with the role for chat, text chunks, a closing chunk with the finish
    reason, and the usage chunk that `stream_options.include_usage` asks for)."""

    chat: bool
    model: str
    prompt_tokens: int
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"

    def _object(self, choices: list[dict], use: dict | None, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                "usage": use}

    def _choice(self, text: str | None, finish: str | None, chunk: bool, role: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if not chunk:
            message = {"role": "assistant", "content": text, "refusal": None}
            return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def whole(self, text: str, finish: str, completion_tokens: int) -> dict:
        """The non-streamed response."""
        return self._object([self._choice(text, finish, False)], usage(self.prompt_tokens, completion_tokens), False)

    def opening(self) -> dict | None:
        """Chat streams open with the assistant role and empty content, as OpenAI's do; completions do not."""
        return self._object([self._choice(None, None, True, role=True)], None, True) if self.chat else None

    def piece(self, text: str) -> dict:
        return self._object([self._choice(text, None, True)], None, True)

    def closing(self, finish: str) -> dict:
        return self._object([self._choice(None, finish, True)], None, True)

    def usage_chunk(self, completion_tokens: int) -> dict:
        return self._object([], usage(self.prompt_tokens, completion_tokens), True)


def sse(data: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
