"""`sluice run MODEL --prompt TEXT`: generate, stream the text, print a stats line (or one JSON object)."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import RequestError
from ..sampling import validate_sampling
from ..tokenizer import check_text
from .common import add_model_arguments, add_sampling_arguments, load_from_args, sampling_kwargs, stats_line


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_sampling_arguments(p)
    p.add_argument("--json", action="store_true",
                   help='print exactly one JSON object: {"tokens": [...], "text": "...", "stats": {...}}')


def main(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise RequestError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    check_text(args.prompt, "--prompt")  # before the model loads
    validate_sampling(**sampling_kwargs(args))
    with load_from_args(args, progress=not args.json) as m:
        pieces = []
        for piece in m.generate(args.prompt, max_tokens=args.max_tokens, stop=args.stop, chat=args.chat,
                                **sampling_kwargs(args)):
            pieces.append(piece)
            if not args.json:
                sys.stdout.write(piece)
                sys.stdout.flush()
        st = m.stats()
        if args.json:
            print(json.dumps({"tokens": m.last_tokens, "text": "".join(pieces), "stats": st}))
        else:
            print()
            print(stats_line(st), file=sys.stderr)
    return 0
