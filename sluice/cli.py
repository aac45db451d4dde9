"""`sluice` / `python -m sluice`: dispatch only. Each command lives in sluice/commands/<name>.py with
`add_arguments(parser)` and `main(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from .errors import MemoryWarning, SluiceError

COMMANDS = {
    "run": "generate text from a prompt",
    "chat": "multi-turn chat in the terminal",
    "serve": "OpenAI-compatible HTTP server (chat completions, completions, models)",
    "inspect": "show a model's architecture, sizes and what a memory budget leaves for experts",
    "make-model": "write a synthetic checkpoint of a real architecture at a requested size",
    "demo": "create the demo model once and generate from it",
    "export-gguf": "write a qwen3_moe checkpoint as GGUF (tokenizer included) so llama.cpp runs the same model",
    "bench": "A/B runs of loading flags: replayed, rotated, paired, cold-verified, against the I/O floor",
    "prerouter": "fit the learned prerouter (--prefetch learned) and report its recall against the router",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Run MoE models larger than memory, exactly.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"sluice.commands.{name.replace('-', '_')}")
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_main=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line(args.command, warnings.showwarning)
            return int(args._main(args) or 0)
    except SluiceError as e:
        print(f"sluice {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


def _one_line(command: str, default):
    """sluice's own warnings (MemoryWarning) as one `sluice CMD: warning: ...` line, others as Python prints them."""

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, MemoryWarning):
            print(f"sluice {command}: warning: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    return show


if __name__ == "__main__":
    sys.exit(main())
