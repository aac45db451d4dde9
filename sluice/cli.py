"""`sluice` / `python -m sluice`: dispatch only. Each command lives in sluice/commands/<name>.py with
`add_arguments(parser)` and `main(args) -> int`.

Whatever a command raises ends as one `sluice COMMAND: error: ...` line on stderr: a SluiceError (bad input, named
by the command) or an OSError (the system refused: disk full, permission) exits 2; anything else is a bug in sluice,
reported as `internal error` with exit 1 -- its traceback is printed too when SLUICE_DEBUG=1 is set.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import os
import sys
import traceback
import warnings

from .errors import SluiceError, SluiceWarning, describe_os_error

DEBUG_ENV = "SLUICE_DEBUG"

COMMANDS = {
    "run": "generate text from a prompt",
    "chat": "multi-turn chat in the terminal",
    "serve": "OpenAI-compatible HTTP server (chat completions, completions, models)",
    "inspect": "show a model's architecture, sizes and what a memory budget leaves for experts",
    "make-model": "write a synthetic checkpoint of a real architecture at a requested size",
    "demo": "create the demo model once and generate from it",
    "export-gguf": "write a checkpoint as GGUF (tokenizer included) so llama.cpp runs the same model",
    "quantize": "write a model folder as a smaller GGUF (q8_0, q4_0, ..., bf16) or MLX 4/8-bit folder",
    "perplexity": "perplexity of a model on a text file (llama.cpp's windows by default, so numbers compare)",
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


def os_error_line(e: OSError) -> str:
    """One line for an OSError that no command turned into a SluiceError: the path(s), the reason, what to do."""
    where = "".join(f"{f}: " for f in (e.filename, e.filename2) if f is not None)
    return where + describe_os_error(e)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prefix = f"sluice {args.command}: error:"
    if not faulthandler.is_enabled():
        # a weight file truncated while the mmap reader copies from it is a SIGBUS no Python code can catch
        # (io/mapped.py): say where it happened instead of dying with a bare "Bus error"
        faulthandler.enable()
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line(args.command, warnings.showwarning)
            return int(args._main(args) or 0)
    except SluiceError as e:
        print(f"{prefix} {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout left (`| head`): not an error
        return 0
    except OSError as e:
        _debug_traceback()
        print(f"{prefix} {os_error_line(e)}", file=sys.stderr)
        return 2
    except BaseException as e:  # noqa: BLE001 - the last resort: one line, not a traceback
        # (BaseException: a panic in a Rust extension, tokenizers or safetensors, is pyo3's PanicException, which
        # derives from it)
        if isinstance(e, (SystemExit, GeneratorExit)):
            raise
        _debug_traceback()
        if isinstance(e, MemoryError) or "can't allocate memory" in str(e):  # (torch's allocator: RuntimeError)
            print(f"{prefix} out of memory: free memory, or ask for less (--memory, --max-context, a smaller "
                  "model)", file=sys.stderr)
            return 2
        what = " ".join(str(e).split())  # one line, however the message was laid out
        what = what if len(what) <= 500 else what[:500] + "..."
        print(f"{prefix} internal error: {type(e).__name__}: {what} (a bug in sluice: please report it with the "
              f"command line; {DEBUG_ENV}=1 prints the traceback)", file=sys.stderr)
        return 1


def _debug_traceback() -> None:
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        traceback.print_exc()


def _one_line(command: str, default):
    """sluice's own warnings (SluiceWarning) as one `sluice CMD: warning: ...` line, others as Python prints them."""

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, SluiceWarning):
            print(f"sluice {command}: warning: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    return show


if __name__ == "__main__":
    sys.exit(main())
