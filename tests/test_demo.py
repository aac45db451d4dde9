"""`sluice demo`: the shipped model inflated, quantized once to a 4-bit GGUF, streamed under a budget smaller than it."""

from __future__ import annotations

import os
import subprocess
import sys


def _demo(cache, *args):
    env = {**os.environ, "SLUICE_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "sluice", "demo", "--size", "40MiB", "--max-tokens", "6", *args],
                          capture_output=True, text=True, env=env, timeout=600)


def test_demo_runs_a_4bit_file_it_makes_once(tmp_path):
    r = _demo(tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    (gguf,) = tmp_path.glob("demo-x*-q4_0.gguf")
    folder = tmp_path / gguf.name.removesuffix("-q4_0.gguf")
    assert gguf.stat().st_size < 0.4 * sum(f.stat().st_size for f in folder.glob("*.safetensors"))  # 4-bit
    assert f"model {gguf.name}:" in r.stderr and "quantizing it to Q4_0" in r.stderr
    assert r.stdout.startswith("When you") and len(r.stdout.strip()) > len("When you")
    assert "decode 6 tok" in r.stderr and "io direct" in r.stderr
    again = _demo(tmp_path)  # reused, not made again; the same greedy text
    assert again.returncode == 0 and "quantizing" not in again.stderr and again.stdout == r.stdout
