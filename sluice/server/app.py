"""The OpenAI-compatible HTTP app: `create_app(engine, model_name, ...)` -> a Starlette ASGI app.

Routes: POST /v1/chat/completions, POST /v1/completions (both streamed as server-sent events or not),
GET /v1/models, GET /v1/models/{id}, GET /health. Every error, including 404/405 and unexpected failures, is
OpenAI's error object with the matching status, so clients report a message instead of a parse failure.

The engine is anything shaped like `sluice.engine.Model` (see `Engine`): tests hand in a small or slowed model.
Encoding runs in Starlette's thread pool (a long prompt should not stall the event loop); generations run where the
app's `Generations` runs them: by default on the one engine thread of `EngineWorker` (`LocalGenerations`), under
`sluice serve --ray` on the model's replicas (serve_ray.py), the engine here then only encoding prompts.

What one request may cost is bounded before it is paid: a body over `max_body` bytes is refused (413) from its
Content-Length or, when it comes chunked, as soon as the bytes received pass the limit, without being held; a prompt
longer than the context is refused (400 context_length_exceeded) after O(context) tokens of work (prompt_limit.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import ConfigError, ContextLengthError, RequestError
from ..units import format_bytes
from ..sampling import validate_sampling
from ..generate import TextStream
from . import schemas as S
from .queue import EngineWorker, Job, QueueFull

# How often a non-streamed request checks whether its client is still there (a streamed one is told at once).
DISCONNECT_POLL_S = 0.2
# Largest request body by default. A full 256K-token context of English is ~1 MiB of JSON (~4 bytes a token), and
# ~2.3 MiB if a client \u-escapes every character of CJK text (json.dumps does by default: 6 bytes a character,
# ~1.5 characters a token); 4 MiB holds either. Its cost is bounded too: the worst 4 MiB of JSON to parse (1.4M empty
# lists) makes 90 MB of Python objects in ~2 s on the 2-core test machine.
DEFAULT_MAX_BODY = 4 * 2**20


class Engine(Protocol):
    """What the server needs from a model (sluice.engine.Model has all of it; serve_ray's ingress, which generates
    elsewhere, hands in a prompts.Prompts, which has all but `generate_tokens`)."""

    tokenizer: Any  # .stream_decoder() -> object with add(id) -> str and flush() -> str
    max_context: int  # KV positions, prompt and completion together

    def encode_chat(self, messages: list[dict]) -> list[int]: ...

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]: ...

    # lazy (a generator): nothing runs until the first id is asked for, and closing it stops the model
    def generate_tokens(self, prompt: Sequence[int], max_tokens: int, **sampling: Any) -> Iterator[int]: ...


def generation_work(engine: Engine, ids: list[int], limit: int, stops: list[str],
                    sampling: dict) -> Callable[[Callable[[str], None], Callable[[], bool]], TextStream]:
    """The job run on the engine thread: `generate_tokens` read through a TextStream (stop strings cut, the cancel
    flag polled per token); its result is the spent stream, whose `completion_tokens` and `finish_reason` ("stop",
    "length" or "cancelled") the reply reports."""

    def work(emit: Callable[[str], None], cancelled: Callable[[], bool]) -> TextStream:
        # generate_tokens is lazy: a job cancelled while it waited never starts the model
        stream = TextStream(engine.generate_tokens(ids, max_tokens=limit, **sampling),
                            engine.tokenizer.stream_decoder(), limit, stops, cancelled)
        for piece in stream:
            emit(piece)
        return stream

    return work


class Generations(Protocol):
    """Where the app's generations run: `submit` queues one (QueueFull when no wait slot is left) and returns its
    Job, whose events are the text pieces and then the outcome (`finish_reason`, `completion_tokens`). `streamed`:
    whether the client reads the pieces as they come (else only their sum is answered, and a runner may send the
    text in one piece)."""

    max_queue: int  # requests that may wait behind the running ones

    def submit(self, ids: list[int], limit: int, stops: list[str], sampling: dict, streamed: bool) -> Job: ...

    def health(self) -> dict: ...  # "busy" (a generation runs), "waiting" (jobs queued), and what else it knows

    def close(self) -> None: ...  # cancel everything queued or running


class LocalGenerations:
    """One generation at a time on this process's engine, `max_queue` waiting behind it (an EngineWorker)."""

    def __init__(self, engine: Engine, max_queue: int):
        self.engine, self.worker = engine, EngineWorker(max_queue)
        self.max_queue = max_queue

    def submit(self, ids: list[int], limit: int, stops: list[str], sampling: dict, streamed: bool) -> Job:
        return self.worker.submit(generation_work(self.engine, ids, limit, stops, sampling))

    def health(self) -> dict:
        return {"busy": self.worker.busy, "waiting": self.worker.waiting}

    def close(self) -> None:
        self.worker.close()


class _JobStream(StreamingResponse):
    """A streamed response that cancels its job however the response ends (done, disconnect, send error)."""

    def __init__(self, content: AsyncIterator[str], job: Job):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


class _ApiKey:
    """ASGI middleware: every HTTP request needs `Authorization: Bearer <key>` (401 otherwise)."""

    def __init__(self, app: ASGIApp, key: str):
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):  # constant time: no key guessing by timing
                what = "no API key was provided" if not got else "the API key is not valid"
                err = S.ApiError(401, f"{what}: send the header 'Authorization: Bearer <key>' with the server's "
                                      "--api-key", code="invalid_api_key")
                await _error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error_response(e: S.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def check_model_name(name: str) -> None:
    """The name is sent back in every response: it must be printable text (a lone surrogate from argv is not)."""
    if not name or not name.isprintable():
        raise ConfigError(f"the model name {name!r} must be printable text (--model-name)")


async def read_body(request: Request, max_body: int) -> bytes:
    """The request's body, refused with 413 once it is known to pass `max_body` bytes: from Content-Length before
    any of it is read, else (chunked transfer) as soon as the bytes received pass the limit."""

    def too_large(what: str) -> S.ApiError:
        return S.ApiError(413, f"the request body {what} this server's limit of {format_bytes(max_body)} "
                               "(sluice serve --max-body): send a shorter prompt, or raise the limit",
                          code="request_too_large")

    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit():  # (h11 has checked it; 16 digits and more are over any limit)
        if len(declared) > 15:
            raise too_large("is over")
        if int(declared) > max_body:
            raise too_large(f"is {format_bytes(int(declared))}, over")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body:
            raise too_large("passed")
        chunks.append(chunk)
    return b"".join(chunks)


class Api:
    """The routes of one served model and the state they share: where generations run (one at a time on the
    engine's worker by default, a bounded queue), the model's name and context, the body limit."""

    def __init__(self, engine: Engine, model_name: str, max_body: int, generations: Generations):
        self.engine, self.model_name, self.max_body = engine, model_name, max_body
        self.generations = generations
        self.created = int(time.time())
        self.ctx = int(engine.max_context)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{name:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]

    # -- routes ------------------------------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        req = S.parse_request(await read_body(request, self.max_body), S.ChatRequest)
        self.check_model(req.model)
        ids = await encode(self.engine.encode_chat, [m.to_template() for m in req.messages], "messages")
        return await self.respond(request, req, ids)

    async def completions(self, request: Request) -> Response:
        req = S.parse_request(await read_body(request, self.max_body), S.CompletionRequest)
        self.check_model(req.model)
        ids = await encode(self.engine.encode_prompt, req.prompt, "prompt")
        return await self.respond(request, req, ids)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def model(self, request: Request) -> Response:
        self.check_model(request.path_params["name"])
        return JSONResponse(self.model_card())

    async def health(self, request: Request) -> Response:
        g = self.generations
        return JSONResponse({"status": "ok", "model": self.model_name, **g.health(), "max_queue": g.max_queue,
                             "max_context": self.ctx})

    # -- their parts -------------------------------------------------------------------------------------------------
    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "sluice"}

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise S.ApiError(404, f"model {name!r} does not exist: this server serves {self.model_name!r}",
                             code="model_not_found", param="model")

    def completion_limit(self, req: S.ChatRequest | S.CompletionRequest, prompt_tokens: int) -> int:
        """The most tokens this request may generate: its own limit, cut to the room left in the context."""
        ctx = self.ctx
        room = ctx - prompt_tokens
        if room < 1:
            raise S.ApiError(400, f"the prompt has {prompt_tokens} tokens, which leaves no room to generate in "
                                  f"the context of {ctx} tokens", code="context_length_exceeded",
                             param="messages" if isinstance(req, S.ChatRequest) else "prompt")
        limit = req.limit()
        if limit is None:
            return room
        if not 1 <= limit <= ctx:
            raise S.ApiError(400, f"{req.limit_param()} must be between 1 and the context size {ctx}, got {limit}",
                             code="invalid_value", param=req.limit_param())
        # A limit past the end of the context is cut to fit (finish_reason "length" says so), as llama.cpp does.
        return min(limit, room)

    def submit(self, req: S.ChatRequest | S.CompletionRequest, ids: list[int]) -> Job:
        limit = self.completion_limit(req, len(ids))
        sampling = req.sampling()
        validate_sampling(**sampling)  # the engine's own ranges, checked before queueing (RequestError -> 400)
        try:
            return self.generations.submit(ids, limit, req.stop, sampling, bool(req.stream))
        except QueueFull as e:
            raise S.ApiError(503, str(e), type="server_error", code="queue_full", headers={"Retry-After": "1"}) from e

    async def respond(self, request: Request, req: S.ChatRequest | S.CompletionRequest, ids: list[int]) -> Response:
        job = self.submit(req, ids)
        reply = S.Reply(chat=isinstance(req, S.ChatRequest), model=self.model_name, prompt_tokens=len(ids))
        if req.stream:
            return _JobStream(_events(job, reply, req.include_usage), job)
        if (done := await wait(job, request)) is None:
            return Response(status_code=499)  # nobody reads it; the status is for the access log
        text, outcome = done
        return JSONResponse(reply.whole(text, outcome.finish_reason, outcome.completion_tokens))


def encode_or_refuse(fn: Callable[..., list[int]], arg: Any, param: str) -> list[int] | S.ApiError:
    """`fn(arg)` (a prompt -> token ids), or the 400 a RequestError becomes.

    The refusal is returned, not raised: a traceback that crosses the thread pool's futures forms a reference cycle
    holding the frames, and the prompt in them, until the cyclic GC happens to run (measured: RSS +5 MB per refused
    3 MB prompt, growing without bound over 90 requests)."""
    try:
        return fn(arg)
    except RequestError as e:
        # Clients that trim history react to this code (tested).
        code = "context_length_exceeded" if isinstance(e, ContextLengthError) else "invalid_value"
        return S.ApiError(400, str(e), code=code, param=param)


async def encode(fn: Callable[..., list[int]], arg: Any, param: str) -> list[int]:
    """Encode in Starlette's thread pool (a long prompt must not stall the event loop)."""
    ids = await run_in_threadpool(encode_or_refuse, fn, arg, param)
    if isinstance(ids, S.ApiError):
        raise ids
    return ids


async def wait(job: Job, request: Request) -> tuple[str, TextStream] | None:
    """The job's (text, spent stream); None (and the job cancelled) if the client went away first."""
    task = asyncio.ensure_future(job.result())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        job.cancel()  # no-op when finished; stops the engine when the client left or the server shuts down
        task.cancel()


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, S.ApiError)
    return _error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    msg = f"{request.method} {request.url.path}: {exc.detail}"
    return _error_response(S.ApiError(exc.status_code, msg, code=code, headers=exc.headers))


async def _client_gone(request: Request, exc: Exception) -> Response:
    # The client left before its body was read whole: nobody reads this answer, and sluice serve's HTTP layer has
    # logged one line (server/http.py). Left to the catch-all below, each one logged a traceback.
    return Response(status_code=499)


async def _request_error(request: Request, exc: Exception) -> Response:
    return _error_response(S.ApiError(400, str(exc)))  # the engine refused the request's values


async def _internal_error(request: Request, exc: Exception) -> Response:
    msg = f"internal error: {type(exc).__name__}: {exc}"
    return _error_response(S.ApiError(500, msg, type="server_error", code="internal_error"))


def create_app(engine: Engine, model_name: str, *, api_key: str | None = None, max_queue: int = 16,
               max_body: int = DEFAULT_MAX_BODY, generations: Generations | None = None) -> ASGIApp:
    """The ASGI app serving `engine` under `model_name`; `max_queue` requests may wait behind the running one;
    request bodies over `max_body` bytes are refused (413). `generations`: where they run (default: on `engine`,
    one at a time, LocalGenerations(engine, max_queue)); the app closes it when it shuts down."""
    if getattr(engine, "tokenizer", None) is None:
        raise ConfigError("the server needs a model folder with tokenizer.json (text in, text out)")
    if isinstance(max_body, bool) or not isinstance(max_body, int) or max_body < 1:
        raise ConfigError(f"max_body must be a positive number of bytes, got {max_body!r}")
    check_model_name(model_name)
    api = Api(engine, model_name, max_body, generations or LocalGenerations(engine, max_queue))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await run_in_threadpool(api.generations.close)

    app = Starlette(
        routes=api.routes(),
        exception_handlers={S.ApiError: _api_error, RequestError: _request_error, HTTPException: _http_error,
                            ClientDisconnect: _client_gone, Exception: _internal_error},
        lifespan=lifespan,
    )
    return _ApiKey(app, api_key) if api_key else app


async def _events(job: Job, reply: S.Reply, include_usage: bool) -> AsyncIterator[str]:
    """The SSE body of a streamed job, ending with `data: [DONE]`.

    An engine error becomes one SSE error event, since the 200 status line is already sent; the openai client
    raises it as an APIError.
    """
    if (opening := reply.opening()) is not None:
        yield S.sse(opening)
    try:
        async for piece in job.stream():
            yield S.sse(reply.piece(piece))
    except RequestError as e:
        yield S.sse(S.ApiError(400, str(e)).body())
        return
    except S.ApiError as e:  # where the generation ran refused or lost it (serve_ray.py: its replica died)
        yield S.sse(e.body())
        return
    except Exception as e:  # noqa: BLE001 - the stream must end with a readable error, not a cut connection
        yield S.sse(S.ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").body())
        return
    outcome: TextStream = job.outcome
    yield S.sse(reply.closing(outcome.finish_reason))
    if include_usage:
        yield S.sse(reply.usage_chunk(outcome.completion_tokens))
    yield S.sse("[DONE]")
