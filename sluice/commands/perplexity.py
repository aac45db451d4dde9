"""`sluice perplexity MODEL --text FILE [--context N] [--stride N]`: how well a model predicts a text.

By default the windows and scoring are llama.cpp's `llama-perplexity` (non-overlapping windows of --context tokens,
the second half of each scored), so a number compares with llama.cpp's on the same GGUF file; --stride switches to
the sliding window of transformers' perplexity guide. See sluice/tools/perplexity.py for the exact definition. Any
model sluice loads (HF folder, MLX folder, GGUF), resident or streamed, with the same memory and I/O flags as run.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from typing import BinaryIO

from ..errors import ConfigError, RequestError
from ..units import format_bytes, parse_size
from .common import add_model_arguments, load_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text file to score ('-' for stdin)")
    p.add_argument("--context", type=int, default=512, metavar="N",
                   help="tokens per window (default 512, as llama.cpp perplexity numbers are usually quoted)")
    p.add_argument("--stride", type=int, default=None, metavar="N",
                   help="sliding windows starting every N tokens, each scoring the tokens no earlier window scored "
                        "(transformers' definition); default: llama.cpp's non-overlapping windows, second half scored")
    p.add_argument("--max-text", default=DEFAULT_MAX_TEXT, metavar="SIZE",
                   help=f"refuse a text longer than this (default {DEFAULT_MAX_TEXT}; ~16M tokens)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the summary line")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_model_arguments(p)
    p.set_defaults(max_context=None)  # the KV cache holds one window: --context


# The most text read by default: wikitext-2's test set, the text perplexity numbers are usually quoted on, is 1.3 MB;
# 64 MiB is ~16M tokens, hours of scoring on a large model. An endless source (/dev/zero, `yes |`) stops there.
DEFAULT_MAX_TEXT = "64MiB"
_PIECE = 2**20  # bytes per read


def read_text(name: str, limit: int) -> str:
    """The text of file `name` (standard input for '-'), read a piece at a time and refused once it passes `limit`
    bytes; ConfigError naming the file if it is not a regular file or not UTF-8.

    Only regular files are opened: a FIFO with no writer would block forever (the open itself blocks), a device like
    /dev/zero never ends. The open is non-blocking, so even a FIFO is refused at once; pipes come in through '-'.
    """
    if name == "-":
        return _decode(_read_at_most(sys.stdin.buffer, name, limit), name)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError(f"--text {name}: no such file") from None
    with os.fdopen(fd, "rb", buffering=0) as f:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ConfigError(f"--text {name}: is a directory; give a text file")
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) \
                else "not a regular file"
            raise ConfigError(f"--text {name}: is {kind}, not a text file; give a file, or pipe the text to "
                              "standard input with --text -")
        os.set_blocking(fd, True)
        return _decode(_read_at_most(f, name, limit), name)


def _read_at_most(f: BinaryIO, name: str, limit: int) -> bytes:
    buf = bytearray()
    while piece := f.read(min(_PIECE, limit + 1 - len(buf))):
        buf += piece
        if len(buf) > limit:
            raise ConfigError(f"--text {name}: more than {format_bytes(limit)} (--max-text); give a shorter text, "
                              "or raise --max-text")
    return bytes(buf)


def _decode(data: bytes, name: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--text {name}: not UTF-8 text (byte {e.start}: {e.reason})") from None


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..tools.perplexity import bos_of, check_windows, perplexity, windows

    check_windows(args.context, args.stride)  # before the text is read or the model loaded
    text = read_text(args.text, parse_size(args.max_text, "--max-text"))
    if not text.strip():
        raise RequestError(f"--text {args.text} is empty")
    args.max_context = args.context
    with load_from_args(args, progress=not args.no_progress) as m:
        if args.context > m.spec.rope.max_position_embeddings:
            raise ConfigError(f"--context {args.context} exceeds the model's max_position_embeddings "
                              f"{m.spec.rope.max_position_embeddings}")
        tok = m._need_tokenizer("perplexity scores text")
        tokens = tok.encode(text, add_special_tokens=True)
        n = len(windows(len(tokens), args.context, args.stride))
        with tqdm(total=n, unit="window", desc="perplexity", disable=True if args.no_progress else None) as bar:
            def tick(r):
                bar.set_postfix_str(f"ppl {r.perplexity:.4f}")
                bar.update(1)

            res = perplexity(m.logits, tokens, args.context, args.stride, bos=bos_of(tok.encode), progress=tick)
    out = res.as_dict()
    if args.json:
        print(json.dumps(out))
    else:
        how = ("llama.cpp's windows: second half scored" if args.stride is None
               else f"sliding windows, stride {args.stride}")
        print(f"perplexity {res.perplexity:.4f} over {res.tokens} tokens ({res.windows} windows of {args.context}, "
              f"{how}; {len(tokens)} tokens in the text)")
    return 0
