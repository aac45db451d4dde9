"""`sluice bench`: paired, replayed, cold-verified A/B runs, reported against the I/O floor (DESIGN.md "Measuring").

    arms.py      "NAME=FLAGS" -> Arm (the flags of `sluice run`, checked against LoadOptions)
    child.py     one run in a fresh process: generate the reference sequence, or replay it and measure
    launch.py    residency before a run (cold / warm), and the child under an optional memory cgroup
    protocol.py  rotation, per-arm summaries, pairing against the reference, the identity gate
    floor.py     the I/O floor: each arm's own reads, recorded in an untimed replay, replayed cold before and after
    disk.py      `sluice bench --disk`: a disk's bandwidth by access pattern (a separate tool)
    report.py    markdown table, results.json, latency.png
"""

from __future__ import annotations

import argparse

from ..errors import SluiceError


class BenchError(SluiceError):
    """A bench run cannot start or continue: bad arm, model not cold, no cgroup, the reference run failed."""


class FlagError(Exception):
    """An arm's flags did not parse (raised by FlagParser; re-raised as a BenchError naming the arm)."""


class FlagParser(argparse.ArgumentParser):
    """argparse that raises FlagError instead of printing usage and exiting, for arms' flag strings."""

    def error(self, message: str):  # type: ignore[override]
        raise FlagError(message)


__all__ = ["BenchError", "FlagError", "FlagParser"]
