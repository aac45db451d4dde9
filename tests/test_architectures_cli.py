"""Every supported architecture through the two front ends a user starts with: `sluice run` and `sluice serve` (one
completion), each a subprocess on a tiny `make-model` checkpoint (hidden 64, 2 layers, 4 experts, its trained-style
tokenizer). Greedy, the same prompt: the server's completion is the run's text and token count."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from sluice.models import supported
from sluice.tools.synth import make_model
from tests.server.test_server import ROOT, free_port, wait_healthy
from tests.test_cli import sluice_cli
from tests.test_synth import tiny

PROMPT, MAX_TOKENS = "hello world", 6


@pytest.fixture(scope="module", params=sorted(supported()))
def checkpoint(request, tmp_path_factory):
    """(architecture, folder) of a tiny bf16 checkpoint."""
    arch = request.param
    return arch, make_model(tmp_path_factory.mktemp(arch) / "m", tiny(arch, dtype="bfloat16"), progress=False)


def test_run_and_serve_complete_the_same(checkpoint, tmp_path):
    arch, folder = checkpoint
    r = sluice_cli("run", str(folder), "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--temperature", "0",
                   "--json", "--threads", "1")
    assert r.returncode == 0, f"{arch}: {r.stderr}"
    ran = json.loads(r.stdout)
    assert 1 <= len(ran["tokens"]) <= MAX_TOKENS, arch

    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sluice", "serve", str(folder), "--port", str(port),
                                 "--model-name", arch, "--threads", "1"], stdout=out, stderr=subprocess.STDOUT,
                                cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, {}, proc)
        reply = httpx.post(f"{url}/v1/completions", json={"model": arch, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                          "temperature": 0}, timeout=120)
        assert reply.status_code == 200, f"{arch}: {reply.text}\n{log.read_text()}"
        body = reply.json()
        assert body["choices"][0]["text"] == ran["text"], arch
        assert body["usage"]["completion_tokens"] == len(ran["tokens"]), arch
    except BaseException:
        print(log.read_text())
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
