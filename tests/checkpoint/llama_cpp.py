"""llama.cpp itself, for the tests that check sluice against the files users download: its converter
(convert_hf_to_gguf.py, as the hub's GGUFs are made), its quantizer and its greedy tokens, each run in a subprocess
with the peers' interpreter (benchmarks/peers/setup.sh makes it: llama-cpp-python built from source, and the
converter's sources unpacked beside it from the same sdist).

Where they are: $SLUICE_PEERS_PYTHON (default benchmarks/peers/.venv/bin/python) and $SLUICE_LLAMA_CPP_SRC (a folder
holding convert_hf_to_gguf.py, conversion/ and gguf-py/: default benchmarks/peers/llama.cpp). Without them the tests
that need them skip, saying which is missing; they carry the `llama_cpp` marker (`pytest -m llama_cpp` runs them
where the peers' environment exists). CI (.ci/run) does not build llama.cpp (~8 min): they skip there.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("llama_cpp_child.py")
SETUP = "bash benchmarks/peers/setup.sh"


def peers_python() -> Path:
    return Path(os.environ.get("SLUICE_PEERS_PYTHON") or ROOT / "benchmarks/peers/.venv/bin/python")


def converter_src() -> Path:
    return Path(os.environ.get("SLUICE_LLAMA_CPP_SRC") or ROOT / "benchmarks/peers/llama.cpp")


def need_peers() -> Path:
    """The peers' interpreter (skips the test, saying why, when it is absent)."""
    py = peers_python()
    if not py.is_file():
        pytest.skip(f"llama.cpp's environment is absent ({py}): `{SETUP}` makes it, or set SLUICE_PEERS_PYTHON")
    return py


def need_converter() -> tuple[Path, Path]:
    """(the peers' interpreter, llama.cpp's converter folder); skips when either is absent."""
    py, src = need_peers(), converter_src()
    if not (src / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is absent ({src}/convert_hf_to_gguf.py): `{SETUP}` unpacks it from the "
                    "llama-cpp-python sdist, or set SLUICE_LLAMA_CPP_SRC to its vendor/llama.cpp")
    return py, src


def _run(argv: list[str], what: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the peers' interpreter has its own packages
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise AssertionError(f"{what} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


def convert(hf: Path, out: Path, outtype: str = "f32", no_mtp: bool = True) -> Path:
    """`hf` (a Hugging Face folder with a tokenizer) as llama.cpp's converter writes it. A tokenizer whose
    pre-tokenizer it does not recognise (a test's own) is written as "qwen2"'s, the name of the split these tests
    train with."""
    py, src = need_converter()
    argv = [str(py), str(CHILD), "convert", str(src), str(hf), "--outfile", str(out), "--outtype", outtype]
    _run(argv + (["--no-mtp"] if no_mtp else []), "convert_hf_to_gguf.py")
    return out


def quantize(src: Path, out: Path, kind: str) -> Path:
    """llama.cpp's own quantizer (llama_model_quantize, what llama-quantize runs): `kind` Q8_0, Q4_K_M, ..."""
    _run([str(need_peers()), str(ROOT / "benchmarks/quality.py"), "quantize", str(src), str(out), kind],
         "llama_model_quantize")
    return out


def greedy(path: Path, ids: list[int], n: int) -> dict:
    """llama.cpp on the GGUF `path`: {"tokens": n greedy tokens after the prompt `ids`, "logits": the prompt's
    logits [len(ids)][vocab]} (its repacking buffers off: on this CPU family they die of SIGILL)."""
    out = _run([str(need_peers()), str(CHILD), "greedy", str(path), json.dumps(ids), str(n)], "llama.cpp")
    return json.loads(out.splitlines()[-1])
