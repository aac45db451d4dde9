"""Arms: named sets of `sluice run` flags, e.g. `direct='--io direct --memory 1.5GiB --io-workers 8'`.

The flags are generated from the load option declarations as for `sluice run` (options.add_load_arguments), so an
arm accepts exactly the loading flags users know, including ones added later, and nothing else. The result is the
keyword arguments of `sluice.load` / `LoadOptions.make`, holding only what the arm sets (defaults stay LoadOptions').
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import SluiceError
from ..options import add_load_arguments, declarations, option_kwargs, options_from_args
from . import BenchError, FlagError, FlagParser
from .peers import is_peer, parse_peer

_NAME = re.compile(r"[A-Za-z0-9_.+:@-]+")


@dataclass(frozen=True)
class Arm:
    """One configuration under test. `options` are LoadOptions keyword arguments; `flags` is what the user wrote.
    A peer arm (`peer:llama.cpp ...`, see peers.py) names its tool in `peer` and holds that tool's options."""

    name: str
    flags: str
    options: dict[str, Any] = field(default_factory=dict)
    peer: str | None = None

    def to_json(self) -> dict[str, Any]:
        """name, flags, options (and the peer, for a peer arm) as written to results.json."""
        out = {"name": self.name, "flags": self.flags, "options": dict(self.options)}
        if self.peer is not None:
            out["peer"] = self.peer
        return out


def _flag_parser() -> FlagParser:
    p = FlagParser(prog="arm", add_help=False, allow_abbrev=False)  # no prefixes: "--mem" is not "--memory"
    # SUPPRESS: flags the arm does not give stay out of the namespace, so LoadOptions' defaults apply
    add_load_arguments(p, defaults={f.name: argparse.SUPPRESS for f, _ in declarations()})
    return p


def parse_flags(name: str, flags: str) -> dict[str, Any]:
    """LoadOptions keyword arguments for an arm's flag string; BenchError naming the arm on any bad flag or value."""
    try:
        tokens = shlex.split(flags)
    except ValueError as e:
        raise BenchError(f"arm {name!r}: cannot split flags {flags!r}: {e}") from e
    try:
        ns = _flag_parser().parse_args(tokens)
    except FlagError as e:
        raise BenchError(f"arm {name!r}: {e} (arms take the loading flags of `sluice run`; see sluice run --help)")
    try:
        options_from_args(ns)  # values checked here, before any child starts
    except SluiceError as e:
        raise BenchError(f"arm {name!r}: {e}") from e
    return option_kwargs(ns)


def parse_arm(spec: str) -> Arm:
    """`NAME=FLAGS` -> Arm. FLAGS may be empty (all defaults), or `peer:KIND [options]` for a peer arm."""
    name, sep, flags = spec.partition("=")
    name = name.strip()
    if not sep or not name:
        raise BenchError(f"--arm {spec!r}: expected NAME='FLAGS', e.g. --arm direct='--io direct --memory 2GiB'")
    if not _NAME.fullmatch(name):
        raise BenchError(f"--arm {spec!r}: the name {name!r} may hold letters, digits and _ . + : @ - only")
    if is_peer(flags):
        kind, options = parse_peer(name, flags)
        return Arm(name, flags.strip(), options, peer=kind)
    return Arm(name, flags.strip(), parse_flags(name, flags))


def parse_arms(specs: Sequence[str]) -> list[Arm]:
    """Arms in the given order (the first is the reference); BenchError on none or a repeated name."""
    if not specs:
        raise BenchError("give at least one --arm NAME='FLAGS' (the first is the reference)")
    arms = [parse_arm(s) for s in specs]
    seen: set[str] = set()
    for a in arms:
        if a.name in seen:
            raise BenchError(f"arm name {a.name!r} is given twice; names label the rows, so they must differ")
        seen.add(a.name)
    return arms


def context_for(prompt_tokens: int, tokens: int) -> int:
    """KV positions a replay of `tokens` steps after a `prompt_tokens` prompt needs, by the rule the llama.cpp arm
    sizes its n_ctx with (peer_child.replay_llama_cpp): max(512, prompt + tokens + 16)."""
    return max(512, prompt_tokens + tokens + 16)


def sized_context(arm: Arm, positions: int) -> Arm:
    """A sluice arm that does not set --max-context, with max_context = positions (the KV cache the work needs, as
    the llama.cpp arm's n_ctx; the default, the model's context up to 4096, took memory the replay never used: 62
    MiB on the 6 GiB-class model at 2,048 tokens, enough to split its prompt in two chunks under a 1 GiB ceiling).
    Peer arms and arms that set it are returned as they are. The reference arm's generate run is sized alike (the
    context decides the prompt's chunks under a ceiling, and so the tokens every arm replays)."""
    if arm.peer is not None or "max_context" in arm.options:
        return arm
    return Arm(arm.name, arm.flags, {**arm.options, "max_context": positions}, arm.peer)

