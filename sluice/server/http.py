"""The HTTP/1.1 connection under the app: uvicorn's h11 protocol with the limits a server facing clients it does not
control needs, which uvicorn (0.54, h11 0.16) does not enforce by itself.

- A read timeout. The request head must arrive whole within `read_timeout` seconds of the connection's opening (of
  its first byte, for a later request on a kept-alive connection), and a body may not pause longer than that;
  otherwise the client gets a 408 and the connection is closed. uvicorn has no such timer: 50 slow-loris connections
  (a header byte at a time) and 1,100 half-sent bodies were held open indefinitely. The head has a deadline, not an
  idle timer, because a byte every few seconds would keep an idle timer alive for hours.
- A request head over h11's limit (16 KiB) gets a 431. uvicorn answered it as malformed (a plain-text 400, then a reset
  the client saw instead), and passed a large head whole when one read brought all of it.
- Malformed HTTP gets a 400 naming what h11 found (uvicorn: "Invalid HTTP request received." in plain text).
- A client gone mid-request is one line in the log ("client 127.0.0.1:5555 disconnected mid-request"), where a
  body cut short used to log a traceback (1,152 in one run).
- A cap on open connections: one over `max_connections` is answered 503 at once and closed. uvicorn's own
  `limit_concurrency` answers in plain text, and only once a request head has arrived whole, so connections that
  never finish their head are never refused and pile up to the process's file limit.

Every answer given here is OpenAI's error object, as the app's are, and is followed by a lingering close: the write
side is shut, and what the client still sends is read and dropped until it closes or `LINGER_S` passes (less for a
connection refused over the cap). Closing at
once with the client's bytes unread makes the kernel reset the connection, and the client loses the answer too (a
200 KB header got a reset, not a response).

`sluice serve` runs this protocol whatever uvicorn would pick (httptools when installed): the hooks are h11's.
"""

from __future__ import annotations

import asyncio
import functools
import http
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..units import format_bytes
from . import schemas as S

# How long an answered connection still reads (and drops) what the client sends before it is closed: enough for a
# client to finish sending a large request over a slow link and read the answer, short enough that a flood of
# refused connections does not hold file descriptors for long.
LINGER_S = 5.0
# The same for a connection refused over the cap: its client has sent at most a request head, which lands within a
# round trip, and in a flood of them each lingering one holds a file descriptor beyond the cap (1,100 connections at
# once: ~1,000 descriptors held for LINGER_S).
REFUSED_LINGER_S = 1.0
# Where a request head ends (h11 accepts bare LF line ends too).
_HEAD_END = re.compile(rb"\n\r?\n")


class _Connection(h11.Connection):
    """h11's connection, keeping the error it found in the request: uvicorn catches it and keeps only its own text."""

    error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.error = e
            raise


@dataclass(frozen=True)
class Limits:
    """What one connection may hold: `read_timeout` seconds to send a request head whole (or to pause in its body),
    and `max_connections` open at once."""

    read_timeout: float = 30.0
    max_connections: int = 128

    def __post_init__(self) -> None:
        if not (isinstance(self.read_timeout, (int, float)) and math.isfinite(self.read_timeout)
                and self.read_timeout > 0):
            raise ValueError(f"read_timeout must be a positive number of seconds, got {self.read_timeout!r}")
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int) \
                or self.max_connections < 1:
            raise ValueError(f"max_connections must be a positive integer, got {self.max_connections!r}")


class SluiceHTTP(H11Protocol):
    """uvicorn's h11 protocol, plus the read timeout and the connection cap of `Limits` (see the module's doc)."""

    def __init__(self, config: uvicorn.Config, server_state: Any, app_state: dict, _loop: Any = None, *,
                 limits: Limits):
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        # the largest request head h11 buffers (its error names it); the connection keeps the error it raises
        self.max_head = config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        self.conn = _Connection(h11.SERVER, self.max_head)
        self.timer: asyncio.TimerHandle | None = None  # the read timeout, or the end of a lingering close
        self.answered = False  # an answer of ours is sent: what the client still sends is dropped

    # -- the protocol's events ---------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.logger.warning("%s: refused: %d connections are open (--max-connections): 503, closed",
                                self.peer(), len(self.connections) - 1)
            self.answer(S.ApiError(503, f"this server already holds {self.limits.max_connections} connections, its "
                                        "limit (sluice serve --max-connections): retry shortly",
                                   type="server_error", code="too_many_connections", headers={"Retry-After": "1"}),
                        linger=REFUSED_LINGER_S)
            return
        self.arm()  # the first request's head: from the connection's opening

    def data_received(self, data: bytes) -> None:
        if self.answered:
            return  # a lingering close: dropped
        if self.conn.their_state is h11.IDLE and self.head_too_large(data):
            self.logger.warning("%s: request head over %s: 431, closed", self.peer(), format_bytes(self.max_head))
            self.answer(self.head_error())
            return
        super().data_received(data)
        if not self.answered:
            self.watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        if not self.answered and self.mid_request():
            # one line: the app sees http.disconnect and drops the request without a traceback (app.py)
            self.logger.info("%s disconnected mid-request", self.peer())
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self.answered:  # uvicorn's own shutdown would send h11 a close for a response h11 never saw
            self.transport.close()
            return
        super().shutdown()

    def mid_request(self) -> bool:
        """Whether the client owes the rest of a request: a head begun, or a body not answered yet."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            return self.cycle is None or not self.cycle.response_complete
        return state is h11.IDLE and bool(self.conn.trailing_data[0])

    # -- the read timeout --------------------------------------------------------------------------------------------
    def arm(self) -> None:
        self.disarm()
        self.timer = self.loop.call_later(self.limits.read_timeout, self.timed_out)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def watch(self) -> None:
        """After bytes arrived: the timer for what the client owes now."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self.arm()  # a body: the timeout counts from its last bytes
        elif state is h11.IDLE:
            if self.timer is None:
                self.arm()  # a head: the deadline counts from its first byte, and does not move
        else:
            self.disarm()  # the request is whole (or the connection is done): the app has it

    def timed_out(self) -> None:
        self.timer = None
        if self.answered or self.transport.is_closing():
            return
        if self.flow.read_paused:  # this side stopped reading (the app has not taken the body yet): not the client
            self.arm()
            return
        if self.cycle is not None and self.cycle.response_started:
            self.transport.close()  # answered before the body was read (a 413): the rest is not needed
            return
        t = f"{self.limits.read_timeout:g} s"
        if self.conn.their_state is h11.SEND_BODY:
            what = f"the request body paused for more than {t}"
        else:
            what = f"the request head (request line and headers) did not arrive whole within {t}"
        self.logger.warning("%s: %s (--read-timeout): 408, closed", self.peer(), what)
        self.answer(S.ApiError(408, f"{what}, this server's read timeout (sluice serve --read-timeout): send the "
                                    "request without pauses", code="request_timeout"))

    # -- answers -----------------------------------------------------------------------------------------------------
    def head_too_large(self, data: bytes) -> bool:
        """Whether the head being read, with `data`, has passed `max_head` bytes without ending. h11 checks this
        only while its buffer holds part of a head: a large head that arrives whole in one read (up to 256 KiB) would
        pass."""
        pending = self.conn.trailing_data[0] + data
        return len(pending) > self.max_head and not _HEAD_END.search(pending, 0, self.max_head + 4)

    def head_error(self) -> S.ApiError:
        return S.ApiError(431, f"the request head (request line and headers) is over {format_bytes(self.max_head)}, "
                               "this server's limit: send shorter headers", code="request_header_fields_too_large")

    def send_400_response(self, msg: str) -> None:
        """What uvicorn calls when h11 refuses the request's bytes (it has logged one line)."""
        e = self.conn.error
        if e is not None and e.error_status_hint == 431:
            self.answer(self.head_error())
        elif self.cycle is not None and self.cycle.response_started:
            self.transport.close()  # the body after an early answer (a 413) is bad: there is nobody left to tell
        else:
            why = str(e or msg)  # h11's words, with the offending bytes (a whole header line at worst): cut short
            why = why if len(why) <= 200 else why[:200] + "..."
            self.answer(S.ApiError(400, f"malformed HTTP request: {why}", code="invalid_http"))

    def answer(self, err: S.ApiError, linger: float = LINGER_S) -> None:
        """Send `err` as the connection's last response and close it, lingering up to `linger` seconds (see the
        module's doc)."""
        self.answered = True
        self.disarm()
        self._unset_keepalive_if_required()
        if self.cycle is not None and not self.cycle.response_complete:
            # an app waiting for the body is told the client left; whatever it answers is dropped
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        body = json.dumps(err.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close"), *((k.encode(), v.encode()) for k, v in (err.headers or {}).items()),
                   *self.server_state.default_headers]
        head = f"HTTP/1.1 {err.status} {http.HTTPStatus(err.status).phrase}\r\n".encode()
        self.transport.write(head + b"".join(k + b": " + v + b"\r\n" for k, v in headers) + b"\r\n" + body)
        self.flow.resume_reading()  # keep reading, to drop what still comes
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.timer = self.loop.call_later(linger, self.transport.close)

    def peer(self) -> str:
        return "client %s:%d" % self.client if self.client else "client"


def uvicorn_config(app: ASGIApp, limits: Limits) -> uvicorn.Config:
    """How `sluice serve` runs `app`: this protocol with `limits`, no WebSocket upgrades (the app has no such route,
    and an upgraded connection would leave these limits), uvicorn's info log, and a bounded graceful shutdown (open
    streams are cancelled by the app's lifespan, not waited for)."""
    return uvicorn.Config(app, http=functools.partial(SluiceHTTP, limits=limits),  # type: ignore[arg-type]
                          ws="none", log_level="info", timeout_graceful_shutdown=5)
