"""`sluice perplexity MODEL --text FILE [--context N] [--stride N]`: how well a model predicts a text.

By default the windows and scoring are llama.cpp's `llama-perplexity` (non-overlapping windows of --context tokens,
the second half of each scored), so a number compares with llama.cpp's on the same GGUF file; --stride switches to
the sliding window of transformers' perplexity guide. See sluice/tools/perplexity.py for the exact definition. Any
model sluice loads (HF folder, MLX folder, GGUF), resident or streamed, with the same memory and I/O flags as run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import ConfigError, RequestError
from .common import add_model_arguments, load_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text file to score ('-' for stdin)")
    p.add_argument("--context", type=int, default=512, metavar="N",
                   help="tokens per window (default 512, as llama.cpp perplexity numbers are usually quoted)")
    p.add_argument("--stride", type=int, default=None, metavar="N",
                   help="sliding windows starting every N tokens, each scoring the tokens no earlier window scored "
                        "(transformers' definition); default: llama.cpp's non-overlapping windows, second half scored")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the summary line")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_model_arguments(p)
    p.set_defaults(max_context=None)  # the KV cache holds one window: --context


def read_text(name: str) -> str:
    """The file's text (or stdin's for '-'); ConfigError naming the file if it cannot be read as UTF-8."""
    if name == "-":
        return sys.stdin.read()
    path = Path(name)
    try:
        return path.read_text("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"--text {name}: no such file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--text {name}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except IsADirectoryError:
        raise ConfigError(f"--text {name}: is a directory; give a text file") from None


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..tools.perplexity import bos_of, perplexity, windows

    text = read_text(args.text)
    if args.context is None or args.context < 2:
        raise ConfigError(f"--context {args.context}: a window needs at least 2 tokens")
    args.max_context = args.context
    with load_from_args(args, progress=not args.no_progress) as m:
        if args.context > m.spec.rope.max_position_embeddings:
            raise ConfigError(f"--context {args.context} exceeds the model's max_position_embeddings "
                              f"{m.spec.rope.max_position_embeddings}")
        tok = m._need_tokenizer("perplexity scores text")
        if not text.strip():
            raise RequestError(f"--text {args.text} is empty")
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
