"""Flags shared by the commands that load a model (run, chat, inspect, bench, serve), and the stats line."""

from __future__ import annotations

import argparse

from ..engine import Model
from ..options import add_load_arguments, format_bytes, options_from_args


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL plus the loading/streaming flags, one per LoadOptions field (options.add_load_arguments)."""
    p.add_argument("model", metavar="MODEL", help="Hugging Face model folder (config.json + safetensors)")
    add_load_arguments(p.add_argument_group("memory and I/O"))


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, metavar="N", help="tokens to generate (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)")


def sampling_kwargs(args: argparse.Namespace) -> dict:
    return dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                repetition_penalty=args.repetition_penalty, seed=args.seed)


def load_from_args(args: argparse.Namespace, progress: bool = True) -> Model:
    """The model named by args.model, loaded with the load options the flags hold."""
    return Model(args.model, options_from_args(args), progress=progress)


def stats_line(st: dict) -> str:
    """One readable line: speeds first, then the cache and I/O counters."""
    parts = [
        f"prompt {st['prompt_tokens']} tok @ {st['prefill_tok_s']:.1f} tok/s"
        + (f", read {format_bytes(st['prefill_bytes_read'])}" if st.get("prefill_bytes_read") else "")
        + (f", passes of {st['prefill_pass_tokens']} tok in {format_bytes(st['prefill_lent_bytes'])} of lent slots"
           if st.get("prefill_lent_bytes") else ""),
        f"decode {st['tokens']} tok @ {st['decode_tok_s']:.2f} tok/s ({st['ms_per_token']:.1f} ms/tok)",
        f"hit rate {100 * st['hit_rate']:.1f}%",
        f"read {format_bytes(st['bytes_read'])}",
        f"faults {st['major_faults']} major / {st['minor_faults']} minor",
        f"peak RSS {format_bytes(st['peak_rss_bytes'])}",
        f"memory {st['memory_plan']}",
        f"io {st['io']}{' (O_DIRECT)' if st.get('odirect') else ''}",
    ]
    if "ple" in st:  # qwen4_exp's n-gram tables: how they are read, the rows and bytes, the time waited on reads
        parts.append(f"PLE {st['ple']}: {st['ple_rows']:,} rows, read {format_bytes(st['ple_bytes_read'])}, "
                     f"waited {st['ple_wait_s']:.3f} s")
    return " | ".join(parts)
