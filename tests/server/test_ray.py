"""`sluice serve --ray`: two replicas of the tiny model behind Ray Serve answer as one `sluice serve` does, and a
replica killed mid-run loses no request that had not started on it and comes back.

One local Ray cluster for the module, started by the CLI in a subprocess on loopback ports and stopped by it (SIGINT)
in the fixture's teardown, whatever the tests did; the teardown then checks that every process of the cluster has
ended (and kills, by pid, any that has not, failing the test). Bounded: 4 tests, 12 generations of at most
GEN_TOKENS tokens per round and two LONG ones left after a few tokens, every wait with a deadline; about a minute
on the 2-core development VM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install -e '.[ray]'; `make test` "
                                        "installs it)")

from benchmarks.common import descendants, processes  # noqa: E402
from sluice.tools.tokenizer_train import train_tokenizer  # noqa: E402

from ..models.tiny import hf_model, write_checkpoint  # noqa: E402
from .test_server import free_port, wait_healthy  # noqa: E402

KEY, NAME = "ray-key", "tiny"
ROOT = Path(__file__).resolve().parents[2]
AUTH = {"Authorization": f"Bearer {KEY}"}
GEN_TOKENS = 300  # per request: ~0.5 s through Ray on one thread, long enough to be caught running
MAX_QUEUE = 10  # 2 running + 10 waiting = the 12 requests; a 13th is refused
REPLICA = b"ray::ServeReplica:sluice:replica"  # the replica processes' title (Ray's `ray::<actor>`)
LONG = 3500  # tokens of a generation its client leaves after a few: greedy "go on" runs all of them (no EOS)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # A context of 4096: prompts + GEN_TOKENS fit, and a generation long enough to leave (LONG). Seed 5: greedy decoding runs 11 of REQUESTS to GEN_TOKENS here
    # (seed 0 ends most at EOS within 10 tokens), long enough to be seen running. float32: in bf16 a replica's answer
    # depends on the requests it served before (the KV cache's reused prefix is not bitwise what a fresh prefill
    # computes: 1-6 of these 12 answers changed with the order, in one process), so replicas and a single server,
    # which see different histories, could not be compared token for token.
    model = hf_model("qwen3_moe", torch.float32, seed=5, max_position_embeddings=4096)
    folder = write_checkpoint(model, tmp_path_factory.mktemp("ray-model"), "per_expert")
    train_tokenizer(folder, vocab_size=300)
    return folder


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> None:
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def replicas(root: int) -> list[int]:
    return sorted(pid for pid, cmd in descendants(root).items() if cmd.startswith(REPLICA))


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def wait_idle(pid: int, timeout: float = 120) -> None:
    """Until `pid` spends under 5% of a CPU over a second: a new replica has loaded its model and waits."""
    def idle() -> bool:
        ticks = cpu_ticks(pid)
        time.sleep(1.0)
        return cpu_ticks(pid) - ticks < os.sysconf("SC_CLK_TCK") // 20

    wait_for(idle, timeout, f"replica {pid} idle after loading")


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := cond():
            return value
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not within {timeout:g} s")


@pytest.fixture(scope="module")
def single(model_dir, tmp_path_factory):
    """A plain `sluice serve` (one model, one thread): the reference answers."""
    port, log = free_port(), tmp_path_factory.mktemp("single") / "serve.log"
    proc = start([sys.executable, "-m", "sluice", "serve", str(model_dir), "--port", str(port), "--model-name", NAME,
                  "--threads", "1", "--max-queue", "16"], log)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", {}, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    """`sluice serve --ray --replicas 2 --threads 1` in a subprocess: (base URL, its process). Its teardown stops it
    and checks that no process of its Ray cluster outlives it."""
    port, log = free_port(), tmp_path_factory.mktemp("ray") / "serve.log"
    proc = start([sys.executable, "-m", "sluice", "serve", str(model_dir), "--ray", "--replicas", "2", "--threads",
                  "1", "--port", str(port), "--api-key", KEY, "--model-name", NAME, "--max-queue", str(MAX_QUEUE)],
                 log)
    url = f"http://127.0.0.1:{port}"
    seen: dict[int, bytes] = {}
    try:
        wait_healthy(url, AUTH, proc, timeout=240)
        wait_for(lambda: len(replicas(proc.pid)) == 2, 60, "two replica processes")
        seen.update(descendants(proc.pid))
        yield url, proc
        seen.update(descendants(proc.pid))
    except Exception:
        print(log.read_text()[-20000:])
        raise
    finally:
        seen.update(descendants(proc.pid))
        stop(proc, signal.SIGINT, timeout=90)

        def alive() -> list[int]:
            procs = processes()
            return [pid for pid, cmd in seen.items() if procs.get(pid, (0, b""))[1] == cmd]

        deadline = time.monotonic() + 30  # ray.shutdown has asked them to stop; give them time to
        while (left := alive()) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert proc.returncode == 0, f"sluice serve --ray exited with {proc.returncode}:\n{log.read_text()[-5000:]}"
        assert not left, f"processes of the Ray cluster outlived it: {[seen[p][:60] for p in left]}"


REQUESTS = [(kind, streamed, f"{kind} number {i}: tell me about replica {i * 7}")
            for i, (kind, streamed) in enumerate([(k, s) for k in ("chat", "completion") for s in (False, True)] * 3)]


def ask(client: openai.OpenAI, kind: str, streamed: bool, text: str) -> tuple[str, int | None]:
    """(text, completion tokens) of one greedy request; with streaming the tokens come in the usage chunk."""
    common = dict(model=NAME, max_tokens=GEN_TOKENS, temperature=0)
    if kind == "chat":
        msgs = [{"role": "user", "content": text}]
        if not streamed:
            r = client.chat.completions.create(messages=msgs, **common)
            return r.choices[0].message.content, r.usage.completion_tokens
        chunks = list(client.chat.completions.create(messages=msgs, stream=True,
                                                     stream_options={"include_usage": True}, **common))
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage.completion_tokens
    if not streamed:
        r = client.completions.create(prompt=text, **common)
        return r.choices[0].text, r.usage.completion_tokens
    chunks = list(client.completions.create(prompt=text, stream=True, stream_options={"include_usage": True},
                                            **common))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens


def ask_all(url: str, key: str) -> list:
    """The 12 requests at once; each a (text, tokens) answer or the exception it raised."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)

    def one(req):
        try:
            return ask(client, *req)
        except openai.APIError as e:
            return e

    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        return list(pool.map(one, REQUESTS))


@pytest.fixture(scope="module")
def reference(single) -> list[tuple[str, int]]:
    answers = ask_all(single, "unused")
    assert all(isinstance(a, tuple) for a in answers), answers
    assert len({text for text, _ in answers}) > 6  # the prompts lead to different answers: a mix-up would show
    long = sum(n == GEN_TOKENS for _, n in answers)
    assert long >= len(answers) // 2, f"only {long} answers run to {GEN_TOKENS} tokens: too short to be seen running"
    return answers


def test_two_replicas_answer_12_concurrent_requests_as_one_sluice_serve(cluster, reference):
    url, _ = cluster
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        answers = pool.submit(ask_all, url, KEY)
        # all 12 held (2 running, 10 waiting): a 13th is refused as `sluice serve` refuses it
        held = wait_for(lambda: (h := httpx.get(f"{url}/health", headers=AUTH, timeout=10).json())["running"] == 2
                        and h["waiting"] == MAX_QUEUE and h, 60, "2 running and 10 waiting")
        assert held["busy"] and held["replicas"] == 2
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=NAME, prompt="one too many", max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "queue_full" and "busy" in e.value.message
        assert answers.result(timeout=180) == reference


def test_the_api_answers_and_refuses_as_sluice_serve(cluster, single):
    url, _ = cluster
    for base, key in ((url, KEY), (single, "unused")):
        c = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
        assert [m.id for m in c.models.list()] == [NAME]
        with pytest.raises(openai.NotFoundError, match="model 'other' does not exist"):
            c.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "word " * 5000}], max_tokens=2)
        assert e.value.body["code"] == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError, match="only n=1 is supported"):
            c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2, n=2)
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})  # no key
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_a_killed_replica_loses_no_waiting_request_and_comes_back(cluster, reference):
    url, proc = cluster
    before = replicas(proc.pid)
    with ThreadPoolExecutor(1) as pool:
        answers = pool.submit(ask_all, url, KEY)
        wait_for(lambda: (h := httpx.get(f"{url}/health", headers=AUTH, timeout=10).json())["running"] == 2
                 and h["waiting"] > 0, 60, "both replicas running with requests waiting")
        victim = before[0]
        os.kill(victim, signal.SIGKILL)
        answers = answers.result(timeout=240)
    # the one generation running on the killed replica may be lost if it was streamed and had sent text (503
    # replica_lost), else it is sent again; every other request, waiting or on the other replica, is answered exactly
    lost = [(req, a) for req, a in zip(REQUESTS, answers) if not isinstance(a, tuple)]
    assert len(lost) <= 1, lost
    for (_, streamed, _), error in lost:
        assert streamed and isinstance(error, openai.APIError) and "replica" in str(error), error
    assert [a for a in answers if isinstance(a, tuple)] == [r for r, a in zip(reference, answers)
                                                            if isinstance(a, tuple)]
    # Ray starts another replica in its place, and it serves
    after = wait_for(lambda: len(now := replicas(proc.pid)) == 2 and victim not in now and now, 180,
                     "a replica in place of the killed one")
    (new,) = set(after) - set(before)
    wait_idle(new)
    ticks = cpu_ticks(new)
    assert ask_all(url, KEY) == reference
    # a generation here is ~0.5 s of CPU; an idle replica spends < 5% of a CPU
    assert cpu_ticks(new) - ticks > os.sysconf("SC_CLK_TCK") // 4, "the new replica took no generation"


def test_a_client_that_leaves_stops_its_generation_on_the_replica(cluster):
    """Streamed (the client closes the stream) or not (the client gives up waiting): the replica stops generating
    at once. Asserted on the replicas' CPU time, not on wall time: a LONG generation that went on would cost them
    LONG times what one token costs (measured first, on a request of up to GEN_TOKENS), a stopped one a few
    tokens' worth."""
    url, proc = cluster
    pids = replicas(proc.pid)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    spent = sum(map(cpu_ticks, pids))
    tokens = ask(client, "completion", False, "how much is a token")[1]
    per_token = (sum(map(cpu_ticks, pids)) - spent) / tokens
    for streamed in (True, False):
        for pid in pids:
            wait_idle(pid)
        spent = sum(map(cpu_ticks, pids))
        if streamed:
            stream = client.completions.create(model=NAME, prompt="go on", max_tokens=LONG, temperature=0,
                                               stream=True)
            assert len([chunk for _, chunk in zip(range(5), stream)]) == 5
            stream.close()
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=httpx.Timeout(30, read=0.5),
                           json={"prompt": "go on", "max_tokens": LONG, "temperature": 0})
        for pid in pids:
            wait_idle(pid)
        used = sum(map(cpu_ticks, pids)) - spent
        assert used < per_token * LONG / 4, f"{streamed=}: {used} ticks, a whole generation ~{per_token * LONG:.0f}"
    health = httpx.get(f"{url}/health", headers=AUTH, timeout=10).json()
    assert (health["running"], health["waiting"]) == (0, 0)
