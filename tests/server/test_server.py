"""`sluice serve`: the real server on a loopback port, driven by the official openai client (and httpx for raw bodies).

Two servers per module: `sluice serve` as a subprocess (the CLI path, with an API key) for the API surface, and the
same app under uvicorn in a thread around a slowed copy of the model (`--max-queue 1`) for queueing and
cancellation, where a generation must last long enough to be interrupted.
"""

from __future__ import annotations

import itertools
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn

import sluice
from sluice.commands.serve import is_loopback
from sluice.server import create_app
from sluice.tools.tokenizer_train import train_tokenizer

from ..models.tiny import hf_model, write_checkpoint

KEY = "test-key"
NAME = "tiny"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = write_checkpoint(hf_model("qwen3_moe", torch.bfloat16), tmp_path_factory.mktemp("serve"), "per_expert")
    train_tokenizer(folder, vocab_size=300)
    return folder


@pytest.fixture(scope="module")
def model(model_dir):
    """The same model in this process: the reference answers, and the engine of the slowed server."""
    threads = torch.get_num_threads()
    m = sluice.load(model_dir, threads=1)  # 2 ms/token with 1 thread; more threads only contend on a busy CI box
    yield m
    m.close()
    torch.set_num_threads(threads)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, headers: dict, proc: subprocess.Popen | None = None, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"sluice serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", headers=headers, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """`sluice serve` in a subprocess; yields the base URL."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve-log") / "serve.log"
    cmd = [sys.executable, "-m", "sluice", "serve", str(model_dir), "--port", str(port), "--api-key", KEY,
           "--model-name", NAME, "--max-queue", "8", "--threads", "1"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, {"Authorization": f"Bearer {KEY}"}, proc)
        yield url
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
def client(server) -> openai.OpenAI:
    # max_retries=0: a 503 or 4xx must reach the test, not be retried away
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=30)


def ask(m, messages: list[dict], max_tokens: int, stop=None) -> tuple[str, int, int, str]:
    """The engine's own greedy answer: (text, prompt tokens, completion tokens, finish reason)."""
    ids = m.encode_chat(messages) if isinstance(messages, list) else m.encode_prompt(messages)
    text = "".join(m.generate(ids, max_tokens=max_tokens, temperature=0.0, stop=stop))
    n = len(m.last_tokens)
    return text, len(ids), n, "length" if n >= max_tokens and stop is None else "stop"


def chat(client, content: str, max_tokens: int, **kw):
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}],
                                          temperature=0, max_tokens=max_tokens, **kw)


# ---- the API surface ----------------------------------------------------------------------------------------------


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    health = httpx.get(f"{server}/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert health["status"] == "ok" and health["model"] == NAME and health["max_context"] == 256


@pytest.mark.parametrize("max_tokens", [3, 120])
def test_chat_matches_engine_with_usage(client, model, max_tokens):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about pathlib."}]
    text, prompt_n, n, finish = ask(model, msgs, max_tokens)
    r = client.chat.completions.create(model=NAME, messages=msgs, temperature=0, max_tokens=max_tokens)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == finish
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (prompt_n, n, prompt_n + n)
    if max_tokens == 3:
        assert finish == "length" and n == 3


def test_chat_stream(client, model):
    msgs = [{"role": "user", "content": "Write a poem about a queue."}]
    text, prompt_n, n, finish = ask(model, msgs, 40)
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, temperature=0, max_completion_tokens=40,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert chunks[-1].usage.prompt_tokens == prompt_n


def test_completions(client, model):
    text, prompt_n, n, finish = ask(model, "The json module", 30)
    r = client.completions.create(model=NAME, prompt="The json module", temperature=0, max_tokens=30)
    assert r.choices[0].text == text and r.choices[0].finish_reason == finish
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_n, n)
    stream = client.completions.create(model=NAME, prompt="The json module", temperature=0, max_tokens=30,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == text


def test_stop_strings(client, model):
    msgs = [{"role": "user", "content": "Write a poem about a queue."}]
    full, _, _, _ = ask(model, msgs, 60)  # 60 tokens of mixed text and U+FFFD (a random model)
    # a stop string from the middle of the greedy text; the answer is everything before its first occurrence
    k = next(i for i in range(len(full) // 3, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    stop = full[k:k + 2]
    expected = full[: full.find(stop)]
    r = client.chat.completions.create(model=NAME, messages=msgs, temperature=0, max_tokens=60,
                                       stop=[stop, "never appears"])
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=NAME, messages=msgs, temperature=0, max_tokens=60, stop=stop,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_seeded_sampling_repeats(client):
    def sample() -> str:
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Roll the dice."}],
                                           temperature=1.5, top_p=0.9, seed=7, max_tokens=16)
        return r.choices[0].message.content

    assert sample() == sample()


def test_wrong_or_missing_key_is_401(server):
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


LONG = "pathlib json datetime " * 120  # far past the 256-token context
CHAT = "/v1/chat/completions"
BAD_REQUESTS = [  # (path, body, status, param)
    (CHAT, b'{"messages": [', 400, None),
    (CHAT, b"[1, 2]", 400, None),
    (CHAT, b"", 400, None),
    (CHAT, {"messages": "hello"}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "temperature": 5}, 400, "temperature"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, 400, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "8"}, 400, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, 400,
     "max_completion_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stop": [""]}, 400, "stop"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400, "top_logprobs"),  # ignored
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 0, "logprobs": False}, 400,
     "top_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": "3"}, 400, "top_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4o"}, 404, "model"),
    ("/v1/completions", {"prompt": LONG, "stream": True}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": [99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_requests_get_4xx_error_objects(server, path, body, status, param):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server}{path}", headers=headers, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == param and "code" in err


def test_http_errors_and_client_exceptions(client, server):
    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{server}/v1/chat/completions", headers=headers, timeout=10).status_code == 405
    r = httpx.get(f"{server}/v1/nothing", headers=headers, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=NAME, messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="context") as e:
        chat(client, LONG, 5)
    assert e.value.code == "context_length_exceeded"
    assert chat(client, "still there?", 3).choices[0].finish_reason in ("stop", "length")


def test_eight_concurrent_clients_get_their_greedy_text(client):
    prompts = [f"Question {i}: what does module number {i} do?" for i in range(8)]

    def one(i: int) -> str:
        if i % 2:  # half of them stream
            stream = chat(client, prompts[i], 24, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        return chat(client, prompts[i], 24).choices[0].message.content

    alone = [one(i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(one, range(8), timeout=120))
    assert together == alone
    assert len(set(alone)) > 1  # the prompts lead to different answers: a mix-up could not pass unnoticed


# ---- queueing and cancellation: a slowed engine behind the same app -------------------------------------------------


class SlowEngine:
    """The tiny model at `delay` s per token, never stopping at EOS: generations last long enough to interrupt."""

    def __init__(self, model, delay: float):
        self.model, self.delay = model, delay
        self.produced = 0
        self.running = threading.Event()

    def __getattr__(self, name):
        return getattr(self.model, name)

    def generate_tokens(self, prompt, max_tokens: int, **kw):
        self.produced = 0
        self.running.set()
        try:
            for token in self.model.generate_tokens(prompt, max_tokens=max_tokens, stop_at_eos=False, **kw):
                time.sleep(self.delay)
                self.produced += 1
                yield token
        finally:
            self.running.clear()


@pytest.fixture(scope="module")
def slow(model):
    """(base URL, SlowEngine) of an in-process uvicorn serving the slowed model with max_queue=1."""
    engine = SlowEngine(model, delay=0.05)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(create_app(engine, NAME, max_queue=1), log_level="warning",
                                        timeout_graceful_shutdown=5))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, {}, timeout=30)
    yield url, engine
    srv.should_exit = True
    thread.join(15)
    sock.close()


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=5).json()


def wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_queue_full_is_503_and_queue_drains(slow):
    url, engine = slow
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    long = chat(c, "a long story", 200, stream=True)  # 10 s unless cancelled
    next(iter(long))
    assert wait_for(engine.running.is_set)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(chat, c, "a short one", 2)  # takes the one wait slot
        assert wait_for(lambda: health(url)["waiting"] == 1)
        with pytest.raises(openai.APIStatusError) as e:
            chat(c, "one too many", 2)
        assert e.value.status_code == 503 and "busy" in e.value.message
        long.close()  # frees the engine; the waiting request runs next
        assert waiting.result(timeout=15).usage.completion_tokens == 2
    assert wait_for(lambda: not health(url)["busy"])


def test_disconnect_cancels_generation(slow, monkeypatch):
    """A client that goes away stops its generation between two tokens, and the engine serves the next request.
    Asserted on token counts, not on time: at 0.2 s a token an uncancelled generation runs its 200 tokens (40 s),
    far more than a loaded machine takes to see the disconnect (a few tokens)."""
    url, engine = slow
    monkeypatch.setattr(engine, "delay", 0.2)
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    for streamed in (True, False):
        if streamed:
            stream = chat(c, "go on forever", 200, stream=True)
            assert len(list(itertools.islice(stream, 3))) == 3
            stream.close()
        else:  # the client gives up waiting for a non-streamed answer
            assert wait_for(lambda: not engine.running.is_set())
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}{CHAT}", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 200},
                           timeout=httpx.Timeout(30, read=0.5))
        # the generation stops: the wait only bounds a hang (uncancelled, it ends by itself after its 200 tokens)
        assert wait_for(lambda: not engine.running.is_set(), timeout=120), f"still generating ({streamed=})"
        assert engine.produced < 200, f"the generation ran to its end ({streamed=})"
        r = chat(c, "next please", 3)
        assert r.usage.completion_tokens == 3 and engine.produced == 3


class BrokenEngine(SlowEngine):
    """Fails after two tokens, as a disk error in the middle of a generation would."""

    def generate_tokens(self, prompt, max_tokens: int, **kw):
        for i, token in enumerate(self.model.generate_tokens(prompt, max_tokens=max_tokens, **kw)):
            if i == 2:
                raise OSError("disk gone")
            yield token


def test_engine_failure_is_an_error_object_not_a_dropped_connection(model):
    from starlette.testclient import TestClient

    body = {"messages": [{"role": "user", "content": "Tell me about pathlib."}], "max_tokens": 50, "temperature": 0}
    # raise_server_exceptions=False: see the response a client gets (Starlette re-raises 500s for the server log)
    with TestClient(create_app(BrokenEngine(model, 0.0), NAME), raise_server_exceptions=False) as tc:
        r = tc.post(CHAT, json=body)
        assert r.status_code == 500 and "disk gone" in r.json()["error"]["message"]
        r = tc.post(CHAT, json={**body, "stream": True})
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert "disk gone" in events[-1] and '"error"' in events[-1]
        # the engine is free again: the worker posts the error before it clears its job, so a loaded machine may
        # answer /health in between (the wait bounds a stuck worker, it times nothing)
        assert wait_for(lambda: tc.get("/health").json()["busy"] is False, timeout=60)


def test_loopback_detection():
    assert all(map(is_loopback, ["127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.168.1.5", "example.org"]))
