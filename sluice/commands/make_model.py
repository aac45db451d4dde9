"""`sluice make-model OUT --arch qwen3_moe --size 2GiB`: a synthetic checkpoint of a real architecture.

Random weights at a requested size, sharded like hub checkpoints, with an offline-trained tokenizer and a ChatML
template (see sluice/synth.py for the size rule and why embeddings default to std 4).

`sluice make-model OUT --from demo --expert-scale N` (or `--size 1GiB`): the trained demo model (or any model folder
given as --from PATH) with every expert N times larger, zero-padded so that every output token is unchanged (see
sluice/inflate.py).
"""

from __future__ import annotations

import argparse
import dataclasses

from ..errors import ConfigError, OutputError
from ..models import archs, supported
from ..units import format_bytes, parse_size
from ..plan import open_index

# CLI flag -> SynthConfig field, for the overrides of the size rule.
_OVERRIDES = {
    "layers": "num_layers",
    "experts": "num_experts",
    "top_k": "top_k",
    "hidden": "hidden_size",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "expert_intermediate": "moe_intermediate_size",
    "vocab": "vocab_size",
    "dtype": "dtype",
    "embed_std": "embed_std",
    "seed": "seed",
    "layout": "layout",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", metavar="OUT", help="folder to write (must not exist or be empty; see --force)")
    # --arch is checked in main, not by argparse: with --from the architecture is the source model's.
    parser.add_argument("--arch", choices=supported(), help="architecture (config.json model_type)")
    parser.add_argument("--size", help="target checkpoint size, e.g. 2GiB, 512MiB (within ~5%%); with --from: "
                                       "the smallest expert scale that reaches it")
    f = parser.add_argument_group("inflating a trained model (instead of random weights)")
    f.add_argument("--from", dest="source", metavar="SOURCE",
                   help="'demo' (the trained model shipped with sluice) or a model folder: copy it with larger, "
                        "zero-padded experts; same output tokens")
    f.add_argument("--expert-scale", type=int, metavar="N",
                   help="with --from: each expert's intermediate size (and bytes) times N")
    g = parser.add_argument_group("overrides of the size rule (the rest is solved to hit --size)")
    g.add_argument("--layers", type=int, help="decoder layers")
    family = ", ".join(f"{t} {a.SYNTH.num_experts} top-{a.SYNTH.top_k}" for t, a in archs().items())
    g.add_argument("--experts", type=int, help=f"experts per MoE layer (default: the family's: {family})")
    g.add_argument("--top-k", type=int, help="experts per token (default: the family's)")
    g.add_argument("--hidden", type=int, help="hidden size")
    g.add_argument("--heads", type=int, help="attention heads (default: hidden / head dim)")
    g.add_argument("--kv-heads", type=int, help="key/value heads (default: heads / 4)")
    g.add_argument("--head-dim", type=int, help="attention head size (default 64 up to hidden 512, else 128; "
                                                "Qwen3.5 / 3.6 and Qwen3-Next: 256)")
    g.add_argument("--expert-intermediate", type=int, help="one expert's intermediate size")
    g.add_argument("--vocab", type=int, help="config.json vocab size (the tokenizer is trained up to it)")
    g.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), help="weight dtype (default bfloat16)")
    g.add_argument("--embed-std", type=float,
                   help="std of the token embeddings (default 4.0: spreads routing like a trained model; "
                        "0.02 routes nearly every token to the same few experts)")
    g.add_argument("--seed", type=int, help="random seed (default 0); same seed, same bytes")
    g.add_argument("--layout", choices=("per_expert", "fused"),
                   help="per_expert: hub names experts.{e}.gate_proj (default); fused: experts.gate_up_proj")
    g.add_argument("--ple-size", metavar="SIZE",
                   help="the per-layer n-gram embedding tables of an architecture that has them (qwen4_exp), e.g. "
                        "8GiB, on top of --size (default: a small table)")
    parser.add_argument("--shard-size", default="1GiB", help="largest shard file (default 1GiB)")
    parser.add_argument("--tie-word-embeddings", action="store_true", help="no lm_head; reuse the embeddings")
    parser.add_argument("--force", action="store_true", help="replace OUT if it is an existing model folder")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    if args.source is not None:
        return _main_inflate(args)
    if args.expert_scale is not None:
        raise ConfigError("--expert-scale needs --from (demo or a model folder)")
    from ..tools.synth import config_for_size, describe, make_model, size_of

    if args.arch is None:
        raise ConfigError(f"--arch is required (one of {', '.join(supported())})")
    if args.size is None:
        raise ConfigError("--size is required, e.g. --size 2GiB")
    overrides = {field: getattr(args, flag) for flag, field in _OVERRIDES.items() if getattr(args, flag) is not None}
    overrides["max_shard_bytes"] = parse_size(args.shard_size, "--shard-size")
    if args.ple_size is not None:
        overrides["ple_bytes"] = parse_size(args.ple_size, "--ple-size")
    overrides["tie_word_embeddings"] = args.tie_word_embeddings
    target = parse_size(args.size, "--size")
    sc = config_for_size(args.arch, target, **overrides)

    try:
        out = make_model(args.out, sc, progress=not args.no_progress, force=args.force)
    except OSError as e:
        raise _output_error(args.out, e) from e

    # Summarise what was written (the vocab may have grown to the tokenizer's; re-read sizes from the files).

    index = open_index(out)
    written = dataclasses.replace(sc, vocab_size=index.config["vocab_size"])
    report = size_of(written)
    files = sorted(p.name for p in out.iterdir())
    print(f"wrote {out}")
    print(f"  {describe(written)}")
    table = f" + n-gram tables {format_bytes(report.table_bytes)}" if report.table_bytes else ""
    print(f"  {report.params / 1e6:,.1f}M params, {format_bytes(index.total_bytes())} of tensors "
          f"(target {format_bytes(target)}{table}), experts {report.expert_share:.1%} of bytes, "
          f"one expert {format_bytes(report.expert_nbytes)}")
    print(f"  files: {', '.join(files)}")
    return 0



def _main_inflate(args: argparse.Namespace) -> int:
    from ..tools.inflate import describe, inflate, plan, resolve_source, scale_for_size

    given = [f"--{flag.replace('_', '-')}" for flag in ("arch", "ple_size", *_OVERRIDES)
             if getattr(args, flag) is not None]
    if args.tie_word_embeddings:
        given.append("--tie-word-embeddings")
    if given:
        raise ConfigError(f"{', '.join(given)} cannot be combined with --from: the source model fixes the shape "
                          "(only --expert-scale or --size, --shard-size, --force, --no-progress apply)")
    if (args.expert_scale is None) == (args.size is None):
        raise ConfigError("with --from give exactly one of --expert-scale N or --size SIZE")
    index = open_index(resolve_source(args.source))
    if args.size is not None:
        scale = scale_for_size(index, parse_size(args.size, "--size"))
    else:
        scale = args.expert_scale
    p = plan(index, scale)  # validates the scale before anything is written
    try:
        out = inflate(args.source, args.out, scale, max_shard_bytes=parse_size(args.shard_size, "--shard-size"),
                      progress=not args.no_progress, force=args.force)
    except OSError as e:
        raise _output_error(args.out, e) from e
    print(f"wrote {out}")
    print(f"  from {index.folder}")
    print(f"  {describe(p)}")
    print(f"  files: {', '.join(sorted(f.name for f in out.iterdir()))}")
    return 0


def _output_error(out: str, e: OSError) -> OutputError:
    # synth.writing_model deletes OUT.partial on any error
    return OutputError(out, e, f"the partial output {out.rstrip('/')}.partial was removed")
