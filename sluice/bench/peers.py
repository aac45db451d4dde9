"""Peer arms: the tools users would pick instead of sluice, run by `sluice bench` beside sluice's own arms.

    --arm llama.cpp='peer:llama.cpp'                      llama-cpp-python on MODEL/model.gguf (`sluice export-gguf`),
                                                          or on MODEL itself when it is a GGUF file; llama.cpp's
                                                          defaults (its repacked CPU buffers on)
    --arm llama.cpp-norepack='peer:llama.cpp --no-extra-bufts'   repacking off (use_extra_bufts=False)
    --arm llama.cpp+random='peer:llama.cpp --madvise random'
    --arm accelerate='peer:accelerate --max-memory 256MiB' transformers + accelerate disk offload

A llama.cpp arm on llama.cpp's defaults whose child crashes (dies of SIGILL, SIGSEGV, ...: the repacked kernels of
an AMX path raised SIGILL on one CPU) is run again with repacking off, and stays so for the rounds after; the run's
record and the report say which it used (`repacking_off`, `repacking_note`). The comparison is against llama.cpp as
users run it, so the defaults are always tried first, on every machine.

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
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import SluiceError
from ..units import parse_size
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
    p.add_argument("--no-extra-bufts", dest="extra_bufts", action="store_const", const=False, default=None,
                   help="use_extra_bufts=False: llama.cpp's repacked CPU buffers off (default: llama.cpp's own "
                        "choice, on; the bench falls back to off by itself when the defaults crash)")
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


# Signals a crash dies of (an OOM kill is SIGKILL, reported as such; a user's SIGTERM / SIGINT is not a crash)
CRASH_SIGNALS = (signal.SIGILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGABRT)


def crash_signal(returncode: int, oom_killed: bool) -> str | None:
    """'SIGILL' when a child died of one of CRASH_SIGNALS (returncode -N), else None."""
    if oom_killed or returncode >= 0:
        return None
    try:
        sig = signal.Signals(-returncode)
    except ValueError:
        return None
    return sig.name if sig in CRASH_SIGNALS else None


def repacking_off(kind: str | None, options: dict[str, Any]) -> dict[str, Any] | None:
    """For a llama.cpp arm on llama.cpp's defaults (repacking not turned off): its options with repacking off, the
    fallback after a crash. None for any other arm (nothing to fall back to)."""
    if kind != "llama.cpp" or options.get("extra_bufts") is False:
        return None
    return {**options, "extra_bufts": False}


def repacking_note(kind: str | None, options: dict[str, Any], runs: Sequence[Any]) -> str | None:
    """Which llama.cpp the arm's runs used, in words, for results.json and the report; None for other arms.

    `runs`: protocol.Run objects of the arm; a fallback is recorded in a run's extra["fallback"]."""
    if kind != "llama.cpp":
        return None
    note = _repacking(options, runs)
    return note + f", MADV_{options['madvise'].upper()} on the mapping" if options.get("madvise") else note


def _repacking(options: dict[str, Any], runs: Sequence[Any]) -> str:
    fell = next((r.extra["fallback"] for r in runs if r.extra.get("fallback")), None)
    if fell is not None:
        return (f"repacking off: llama.cpp's defaults died of {fell['signal']} in round {fell['round']} on this "
                "machine (use_extra_bufts=False from then on)")
    if options.get("extra_bufts") is False:
        return "repacking off (--no-extra-bufts)"
    # what the child saw: True, or "not in this llama.cpp" for an old one without the field
    used = {str(r.record.get("peer", {}).get("settings", {}).get("use_extra_bufts")) for r in runs if r.ok}
    if used == {"True"}:
        return "llama.cpp's defaults (repacked CPU buffers on)"
    return "llama.cpp's defaults" + (f" (use_extra_bufts: {', '.join(sorted(used))})" if used else "")
