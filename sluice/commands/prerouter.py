"""`sluice prerouter fit MODEL`: fit the learned prerouter's heads (`--prefetch learned`) and report their recall.

Records (residual stream after layer L's attention, true experts of the next MoE layer) over a corpus, fits one
head per layer, prints held-out recall of `learned` against the training-free `router`, and writes
MODEL/prerouter.safetensors (see sluice/tools/prerouter_fit.py for how the recording leaves the model untouched).
"""

from __future__ import annotations

import argparse
import json
import sys

from ..options import add_load_arguments, option_kwargs
from ..prerouter.predict import HEAD_KINDS, PREROUTER_FILE


# the load options that matter while recording (fit sets max_context to --seq-len)
LOAD_OPTIONS = ("memory", "io", "dtype", "threads")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    f = sub.add_parser("fit", help="record routing over a corpus and fit one head per layer",
                       description="Fit the learned prerouter's heads and write them beside the model.")
    f.add_argument("model", metavar="MODEL", help="Hugging Face model folder (config.json + safetensors)")
    f.add_argument("--prompts", metavar="FILE", default=None,
                   help="text to record over, documents separated by blank lines (default: a built-in corpus; "
                        "a model without tokenizer.json gets random token ids)")
    f.add_argument("--tokens", type=int, default=4096, metavar="N",
                   help="tokens to record, fed one at a time (default 4096; 10%% held out for the report)")
    f.add_argument("--seq-len", type=int, default=256, metavar="N", help="tokens per sequence (default 256)")
    f.add_argument("--kind", choices=HEAD_KINDS, default="linear",
                   help="linear: [E, H] + bias per layer (default); mlp: linear + a SiLU MLP")
    f.add_argument("--epochs", type=int, default=20, metavar="N", help="passes over the training tokens (20)")
    f.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    f.add_argument("--hidden", type=int, default=256, metavar="D", help="MLP width for --kind mlp (default 256)")
    f.add_argument("--margin", type=int, default=None, metavar="N",
                   help="report recall@(top_k + N) too (default top_k // 2)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--out", metavar="PATH", default=None,
                   help=f"heads file to write (default MODEL/{PREROUTER_FILE}, where --prefetch learned looks)")
    g = f.add_argument_group("loading (for models bigger than memory)")
    add_load_arguments(g, only=LOAD_OPTIONS)
    f.add_argument("--json", action="store_true", help="print the report as one JSON object")
    f.add_argument("--no-progress", action="store_true", help="no progress bars")


def main(args: argparse.Namespace) -> int:
    from ..tools.prerouter_fit import FitOptions, fit

    opts = FitOptions(tokens=args.tokens, seq_len=args.seq_len, kind=args.kind, epochs=args.epochs, lr=args.lr,
                      hidden=args.hidden, margin=args.margin, seed=args.seed)
    report = fit(args.model, opts, prompts=args.prompts, out=args.out, progress=not args.no_progress,
                 **option_kwargs(args))
    if args.json:
        print(json.dumps(report.as_dict()))
        return 0
    print(f"{report.kind} heads, held-out recall over {report.heldout_tokens} tokens (trained on "
          f"{report.train_tokens}, 10% of them picking each head's epoch; recorded in {report.record_s:.1f} s, "
          f"fit in {report.fit_s:.1f} s):")
    print(report.table())
    print(f"wrote {report.path}", file=sys.stderr)
    return 0
