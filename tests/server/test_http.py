"""`sluice serve` at the HTTP level, below the app: the read timeout, the connection cap, answers to requests h11
refuses (a head too large, malformed HTTP) and what a client that leaves mid-request costs the log.

Raw sockets on loopback against `sluice serve` subprocesses (the real stack). Two servers: `quick` with
`--read-timeout 1`, `capped` with `--max-connections 3` and the default read timeout. No test asserts how fast
anything happens: each waits up to `WAIT_S` for what it expects, far past the 1 s timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from uvicorn.server import ServerState

from sluice.server.http import Limits, SluiceHTTP
from sluice.tools.tokenizer_train import train_tokenizer

from ..models.tiny import hf_model, write_checkpoint
from .test_server import ROOT, free_port, wait_healthy

WAIT_S = 10.0  # the longest any test waits for the server to act; its timeout is 1 s
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = write_checkpoint(hf_model("qwen3_moe", torch.bfloat16), tmp_path_factory.mktemp("http"), "per_expert")
    train_tokenizer(folder, vocab_size=300)
    return folder


@contextlib.contextmanager
def serve(model_dir: Path, log: Path, *flags: str) -> Iterator[tuple[str, int]]:
    """(base URL, port) of `sluice serve MODEL *flags`, its output going to `log`."""
    port = free_port()
    cmd = [sys.executable, "-m", "sluice", "serve", str(model_dir), "--port", str(port), "--threads", "1", *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, {}, proc)
        yield url, port
    except Exception:
        print(log.read_text())
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture(scope="module")
def quick(model_dir, tmp_path_factory):
    """(base URL, port, log path) of a server with a 1 s read timeout."""
    log = tmp_path_factory.mktemp("http-quick") / "serve.log"
    with serve(model_dir, log, "--read-timeout", "1") as (url, port):
        yield url, port, log


@pytest.fixture(scope="module")
def capped(model_dir, tmp_path_factory):
    """(base URL, port, log path) of a server that holds at most 3 connections (and the default read timeout)."""
    log = tmp_path_factory.mktemp("http-capped") / "serve.log"
    with serve(model_dir, log, "--max-connections", "3", "--max-queue", "1") as (url, port):
        yield url, port, log


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset raises: the client would lose the answer)."""
    out, deadline = b"", time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            got = sock.recv(65536)
        except TimeoutError:
            break
        if not got:
            return out
        out += got
    raise AssertionError(f"the server kept the connection open for {WAIT_S} s; it sent {out[:300]!r}")


def drip(sock: socket.socket, data: bytes, gap: float = 0.1) -> bytes:
    """Send `data` a byte every `gap` s (a slow-loris client) until the server answers; then what it sends until it
    closes."""
    deadline = time.monotonic() + WAIT_S
    for byte in data:
        if time.monotonic() > deadline:
            break
        sock.sendall(bytes([byte]))
        if select.select([sock], [], [], gap)[0]:
            return read_until_closed(sock)
    raise AssertionError(f"the server took {WAIT_S} s of header bytes, one every {gap} s, without answering")


def parse(raw: bytes) -> tuple[int, dict[str, str], dict]:
    """(status, headers, JSON body) of one HTTP response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    assert headers.get("content-type") == "application/json", raw[:300]
    assert int(headers["content-length"]) == len(body), raw[:300]
    return int(lines[0].split()[1]), headers, json.loads(body)


def assert_error(raw: bytes, status: int, code: str, needle: str, type: str = "invalid_request_error") -> dict:
    got, headers, body = parse(raw)
    err = body["error"]
    assert (got, err["code"], err["type"]) == (status, code, type), raw[:400]
    assert needle in err["message"] and "param" in err, err
    assert headers["connection"] == "close"
    return headers


# ---- 1. the read timeout and the connection cap ----------------------------------------------------------------------

HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize("how", ["silent", "slow head", "half body"])
def test_a_stalled_request_gets_408_and_is_closed(quick, how):
    url, port, _ = quick
    with connect(port) as s:
        if how == "silent":  # connects and sends nothing
            raw = read_until_closed(s)
        elif how == "slow head":  # a byte every 0.1 s: within any idle timeout, never a whole head
            raw = drip(s, HEAD + b"X-Slow: " + b"a" * 10_000)
        else:  # a whole head, then 10 of the 1,000 body bytes it announced
            s.sendall(HEAD + b"Content-Length: 1000\r\n\r\n" + b'{"messages')
            raw = read_until_closed(s)
    needle = "request body paused" if how == "half body" else "request head"
    assert_error(raw, 408, "request_timeout", needle)
    assert "--read-timeout" in json.loads(raw.partition(b"\r\n\r\n")[2])["error"]["message"]
    assert httpx.get(f"{url}/health", timeout=WAIT_S).status_code == 200


def test_requests_sent_in_time_are_not_cut(quick):
    """The timeout is for stalls: kept-alive requests and a body sent in two pieces pass."""
    url, port, _ = quick
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    with httpx.Client(base_url=url, timeout=WAIT_S) as c:  # one kept-alive connection
        for _ in range(3):
            assert c.post(CHAT, content=body).status_code == 200
    with connect(port) as s:
        s.sendall(HEAD + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body[:5])
        s.sendall(body[5:])
        raw = read_until_closed(s)
    assert raw.startswith(b"HTTP/1.1 200 "), raw[:300]


def test_connections_over_the_cap_get_503(capped):
    url, port, log = capped
    held = [connect(port) for _ in range(3)]  # idle: the default read timeout (30 s) keeps them open
    try:
        r = httpx.get(f"{url}/health", timeout=WAIT_S)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        err = r.json()["error"]
        assert err["code"] == "too_many_connections" and err["type"] == "server_error"
        assert "--max-connections" in err["message"]
        with connect(port) as s:  # a raw client too: answered without sending anything, then closed
            assert_error(read_until_closed(s), 503, "too_many_connections", "3 connections", type="server_error")
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + WAIT_S  # once the server has seen them close, there is room again
    while httpx.get(f"{url}/health", timeout=WAIT_S).status_code != 200:
        assert time.monotonic() < deadline, "still refused after the held connections closed"
        time.sleep(0.1)
    assert "refused: 3 connections are open" in log.read_text()


def test_max_connections_raises_the_open_file_limit_when_it_must():
    """A cap above the soft open-file limit would be EMFILE at accept, not a 503: the soft limit is raised (in a
    child process, to leave this one's alone)."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2000:
        pytest.skip(f"the hard open-file limit here is {hard}: no room to raise the soft one to 1,064")
    code = ("import resource; from sluice.commands.serve import check_connections; "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1])); "
            "check_connections(1000, 16); print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and int(out.stdout) >= 1000, out.stderr


# ---- 2. a head too large ---------------------------------------------------------------------------------------------


def test_a_200_kb_header_gets_431_not_a_reset(quick):
    url, port, _ = quick
    big = b"a" * 200_000
    with connect(port) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + big + b"\r\n\r\n")  # all of it is read
        raw = read_until_closed(s)  # before: "Connection reset by peer" here
    assert_error(raw, 431, "request_header_fields_too_large", "16.0 KiB")
    r = httpx.get(f"{url}/health", headers={"X-Big": big.decode()}, timeout=WAIT_S)
    assert r.status_code == 431 and "shorter headers" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/health", timeout=WAIT_S).status_code == 200



# ---- 3. malformed HTTP -----------------------------------------------------------------------------------------------

MALFORMED = [  # (what the client sends, what h11 says)
    (b"GARBAGE\r\n\r\n", "illegal request line"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", "illegal header line"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"x" * 10_000 + b"\r\n\r\n", "..."),  # h11 quotes it: cut short
    (bytes.fromhex("160301020001000001fc0303") + bytes(64), "illegal request line"),  # TLS to a plain HTTP port
    (b"GET /health HTTP/1.1\r\n\r\n", "Missing mandatory Host: header"),
    (HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", "illegal chunk header"),  # while the app reads the body
]


@pytest.mark.parametrize("sent,needle", MALFORMED)
def test_malformed_http_gets_400_error_object(quick, sent, needle):
    url, port, _ = quick
    with connect(port) as s:
        s.sendall(sent)
        raw = read_until_closed(s)  # before: 400 "Invalid HTTP request received." in plain text
    headers = assert_error(raw, 400, "invalid_http", needle)
    assert int(headers["content-length"]) < 500
    assert httpx.get(f"{url}/health", timeout=WAIT_S).status_code == 200



# ---- 4. a client gone mid-request ------------------------------------------------------------------------------------


@pytest.mark.parametrize("sent", [HEAD + b"Content-Length: 1000\r\n\r\n" + b'{"messa', HEAD[:30]],
                         ids=["mid-body", "mid-head"])
def test_a_client_gone_mid_request_is_one_log_line(capped, sent):
    url, port, log = capped
    start = len(log.read_text())
    for _ in range(5):
        with connect(port) as s:
            s.sendall(sent)
            line = f"client 127.0.0.1:{s.getsockname()[1]} disconnected mid-request"
        deadline = time.monotonic() + WAIT_S
        while line not in log.read_text()[start:]:  # one at a time: the connection cap is 3
            assert time.monotonic() < deadline, f"no {line!r} in the log: {log.read_text()[start:][-2000:]}"
            time.sleep(0.05)
    assert httpx.get(f"{url}/health", timeout=WAIT_S).status_code == 200
    logged = log.read_text()[start:]
    assert logged.count("disconnected mid-request") == 5, logged[-2000:]
    assert "Traceback" not in logged and "Exception in ASGI application" not in logged, logged[-3000:]  # before: 5


class Transport(asyncio.Transport):
    """A connection's transport that records what the protocol writes."""

    def __init__(self):
        super().__init__()
        self.written, self.eof, self.closed = b"", False, False

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 5555), "sockname": ("127.0.0.1", 8080)}.get(name, default)

    def write(self, data):
        self.written += data

    def can_write_eof(self):
        return True

    def write_eof(self):
        self.eof = True

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


def test_a_large_head_in_one_read_gets_431():
    """h11 limits a head only while part of it waits in its buffer: a 100 KB head read whole at once (a loaded
    server reads up to 256 KiB at a time) reached the app. The protocol alone, fed that one read."""

    async def app(scope, receive, send):
        raise AssertionError("the app was handed a 100 KB head")

    async def run() -> Transport:
        config = uvicorn.Config(app, log_config=None, lifespan="off")
        protocol, transport = SluiceHTTP(config, ServerState(), {}, limits=Limits()), Transport()
        protocol.connection_made(transport)
        protocol.data_received(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
        await asyncio.sleep(0.1)  # (the app's task, had one been started, runs and answers here)
        protocol.connection_lost(None)
        return transport

    transport = asyncio.run(run())
    assert_error(transport.written, 431, "request_header_fields_too_large", "16.0 KiB")
    assert transport.eof  # the write side is shut; the connection lingers to read what the client still sends
