"""Flags shared by the commands that load a model (run, chat, inspect, bench, serve), and the stats line."""

from __future__ import annotations

import argparse

from ..engine import Model
from ..io import DEFAULT_WORKERS
from ..options import IO_MODES, MAX_IO_WORKERS, MAX_THREADS, LoadOptions, format_bytes


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL plus the loading/streaming flags, with the LoadOptions defaults."""
    p.add_argument("model", metavar="MODEL", help="Hugging Face model folder (config.json + safetensors)")
    g = p.add_argument_group("memory and I/O")
    g.add_argument("--memory", metavar="SIZE", default="auto",
                   help="budget for resident weights + expert cache, e.g. 4GiB; 'all' = everything resident; "
                        "'auto' (default) = resident if the model fits in the memory available (MemAvailable, "
                        "cgroup limits), else stream experts with that memory as the budget")
    g.add_argument("--io", choices=IO_MODES, default="direct", help="how expert bytes are read (default: direct)")
    g.add_argument("--io-workers", type=int, default=0, metavar="N",
                   help=f"direct-read threads (default: measured, {DEFAULT_WORKERS}; at most {MAX_IO_WORKERS})")
    g.add_argument("--odirect", action=argparse.BooleanOptionalAction, default=None,
                   help="read with O_DIRECT, bypassing the page cache (default: on when streaming a model that the "
                        "memory left beside the budget could not cache anyway)")
    g.add_argument("--embeddings", choices=["resident", "mmap", "direct"], default="resident",
                   help="token embedding rows: resident, or read per batch from disk (default: resident)")
    g.add_argument("--prefetch", choices=["none", "router", "learned"], default="none",
                   help="predict the next layer's experts and read them in the background (default: none)")
    g.add_argument("--prefetch-margin", type=int, default=0, metavar="N",
                   help="experts predicted beyond top_k per token (default 0)")
    g.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="run a layer's experts that are in memory while the others are read (default: on)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (default: the checkpoint's)")
    g.add_argument("--max-context", type=int, default=4096, metavar="N", help="KV cache positions (default 4096)")
    g.add_argument("--prefill-chunk", type=int, default=256, metavar="N", help="prompt tokens per pass (256)")
    g.add_argument("--threads", type=int, default=0, metavar="N",
                   help=f"torch threads (default: the CPUs this process may use; at most {MAX_THREADS}, this machine's logical CPUs)")


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


def options_from_args(args: argparse.Namespace) -> LoadOptions:
    """The LoadOptions of the flags add_model_arguments declared."""
    return LoadOptions.make(memory=args.memory, io=args.io, io_workers=args.io_workers, odirect=args.odirect,
                            dtype=args.dtype, max_context=args.max_context, prefill_chunk=args.prefill_chunk,
                            threads=args.threads, embeddings=args.embeddings, prefetch=args.prefetch,
                            prefetch_margin=args.prefetch_margin, overlap=args.overlap)


def load_from_args(args: argparse.Namespace, progress: bool = True) -> Model:
    return Model(args.model, options_from_args(args), progress=progress)


def stats_line(st: dict) -> str:
    """One readable line: speeds first, then the cache and I/O counters."""
    parts = [
        f"prompt {st['prompt_tokens']} tok @ {st['prefill_tok_s']:.1f} tok/s",
        f"decode {st['tokens']} tok @ {st['decode_tok_s']:.2f} tok/s ({st['ms_per_token']:.1f} ms/tok)",
        f"hit rate {100 * st['hit_rate']:.1f}%",
        f"read {format_bytes(st['bytes_read'])}",
        f"faults {st['major_faults']} major / {st['minor_faults']} minor",
        f"peak RSS {format_bytes(st['peak_rss_bytes'])}",
        f"memory {st['memory_plan']}",
        f"io {st['io']}{' (O_DIRECT)' if st.get('odirect') else ''}",
    ]
    return " | ".join(parts)
