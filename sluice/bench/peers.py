"""Peer arms: the tools users would pick instead of sluice, run by `sluice bench` beside sluice's own arms.

    --arm llama.cpp='peer:llama.cpp'                      llama-cpp-python on MODEL/model.gguf (`sluice export-gguf`),
                                                          or on MODEL itself when it is a GGUF file
    --arm llama.cpp+random='peer:llama.cpp --madvise random'
    --arm accelerate='peer:accelerate --max-memory 256MiB' transformers + accelerate disk offload

A peer runs in its own environment (benchmarks/peers/setup.sh builds one), so its child is started with that
environment's interpreter (`sluice bench --peer-python PATH`) on sluice/bench/peer_child.py, a script that imports
nothing from sluice: a llama.cpp process carries no torch. Peers replay the same prompt ids and tokens as sluice's arms
(teacher forcing: llama.cpp evaluates the given token, transformers runs a forward with the KV cache), report the same
record, and are checked against the reference arm's argmax; the reference arm must be a sluice arm (it draws the
prompt and generates the sequence every arm replays).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from ..errors import SluiceError
from ..options import parse_size
from . import BenchError, FlagError, FlagParser

PREFIX = "peer:"
CHILD = Path(__file__).with_name("peer_child.py")
DEFAULT_GGUF = "model.gguf"  # inside the model folder, so the cold protocol evicts it with the checkpoint


def _llama_cpp_parser() -> FlagParser:
    p = FlagParser(prog="peer:llama.cpp", add_help=False, allow_abbrev=False)
    p.add_argument("--gguf", help=f"GGUF file (default MODEL/{DEFAULT_GGUF}, written by `sluice export-gguf`)")
    p.add_argument("--threads", type=int, help="n_threads (default: every CPU, as sluice's torch uses)")
    p.add_argument("--no-mmap", dest="mmap", action="store_false", help="use_mmap=False (read the file at load)")
    p.add_argument("--mlock", action="store_true", help="use_mlock=True")
    p.add_argument("--madvise", choices=("random", "sequential", "willneed"),
                   help="madvise the GGUF mapping after load (random: no readahead around each fault)")
    p.add_argument("--extra-bufts", action="store_true",
                   help="use_extra_bufts=True (CPU repacking buffers; SIGILL on this host's AMX path when quantized)")
    p.add_argument("--n-batch", type=int, default=512, help="n_batch (prompt evaluation batch, 512)")
    return p


def _accelerate_parser() -> FlagParser:
    p = FlagParser(prog="peer:accelerate", add_help=False, allow_abbrev=False)
    p.add_argument("--max-memory", default="256MiB",
                   help="max_memory['cpu'] for device_map='auto'; the rest is offloaded to disk (256MiB)")
    p.add_argument("--offload-folder", help="offload_folder (default: a fresh temporary folder, deleted after)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's own)")
    p.add_argument("--dtype", choices=("bfloat16", "float32", "float16"),
                   help="dtype to load in (default: config.json's)")
    return p


PEERS = {"llama.cpp": _llama_cpp_parser, "accelerate": _accelerate_parser}


def is_peer(flags: str) -> bool:
    """True for an arm whose flags start with `peer:`."""
    return flags.strip().startswith(PREFIX)


def parse_peer(name: str, flags: str) -> tuple[str, dict[str, Any]]:
    """`peer:KIND [options]` -> (KIND, options as a dict); BenchError naming the arm on anything unknown."""
    try:
        tokens = shlex.split(flags.strip()[len(PREFIX):])
    except ValueError as e:
        raise BenchError(f"arm {name!r}: cannot split {flags!r}: {e}") from e
    if not tokens or tokens[0] not in PEERS:
        raise BenchError(f"arm {name!r}: {flags!r} names no peer; known: "
                         + ", ".join(f"{PREFIX}{k}" for k in PEERS))
    kind = tokens[0]
    try:
        opts = vars(PEERS[kind]().parse_args(tokens[1:]))
    except FlagError as e:
        raise BenchError(f"arm {name!r}: {PREFIX}{kind}: {e}") from None
    if kind == "accelerate":
        try:  # checked now, passed on as written
            parse_size(opts["max_memory"], "--max-memory")
        except SluiceError as e:
            raise BenchError(f"arm {name!r}: {PREFIX}{kind}: {e}") from None
    for key in ("threads", "n_batch"):
        if opts.get(key) is not None and opts[key] < 1:
            raise BenchError(f"arm {name!r}: --{key.replace('_', '-')} must be >= 1")
    return kind, opts


def resolved(kind: str, options: dict[str, Any], model: str) -> dict[str, Any]:
    """Options with the model-dependent defaults filled in (the GGUF path)."""
    out = dict(options)
    if kind == "llama.cpp" and not out.get("gguf"):  # the model itself when it is a GGUF file
        out["gguf"] = str(model) if Path(model).is_file() else str(Path(model) / DEFAULT_GGUF)
    return out


def peer_files(kind: str, options: dict[str, Any], model: str) -> list[Path]:
    """Files besides the model folder's that a peer reads, so the cold protocol evicts and verifies them too."""
    if kind == "llama.cpp":
        return [Path(resolved(kind, options, model)["gguf"])]
    return []


def check_peer(kind: str, options: dict[str, Any], model: str, python: str | None) -> None:
    """Fail before any child runs: no interpreter for peers, or the llama.cpp arm's GGUF missing."""
    if not python:
        raise BenchError(f"{PREFIX}{kind} arms run in the peers' environment: pass --peer-python PATH "
                         "(bash benchmarks/peers/setup.sh makes benchmarks/peers/.venv/bin/python)")
    if not Path(python).is_file():
        raise BenchError(f"--peer-python {python}: no such file (run bash benchmarks/peers/setup.sh)")
    if kind == "llama.cpp":
        gguf = Path(resolved(kind, options, model)["gguf"])
        if not gguf.is_file():
            raise BenchError(f"{PREFIX}llama.cpp: {gguf} not found; write it with "
                             f"`sluice export-gguf {model} {gguf}` or pass --gguf PATH")


def peer_argv(python: str, kind: str, options: dict[str, Any], model: str, **extra: Any) -> list[str]:
    """argv of `PYTHON sluice/bench/peer_child.py replay --peer KIND ...` (extra: --key value, None dropped)."""
    argv = [python, str(CHILD), "replay", "--peer", kind, "--model", str(model),
            "--options", json.dumps(resolved(kind, options, model))]
    for k, v in extra.items():
        if v is not None:
            argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv
