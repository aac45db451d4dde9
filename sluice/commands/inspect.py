"""`sluice inspect MODEL [--memory SIZE]`: architecture, parameter and byte split, per-token expert traffic, what
a budget leaves for the expert cache, and expert usage on a sample prompt."""

from __future__ import annotations

import argparse
import json

from ..engine import Model
from ..quant.matmul import describe_matmul
from ..models.spec import KVCache
from ..units import format_bytes
from ..plan import LoadPlan, plan
from .common import add_model_arguments, options_from_args

SAMPLE = "The quick brown fox jumps over the lazy dog. In the beginning was the word, and the word was with God."


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--usage-tokens", type=int, default=32, metavar="N",
                   help="route N tokens of a sample prompt and report experts used per layer (0 = skip)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def describe(p: LoadPlan) -> dict:
    """Everything `inspect` reports from a load plan (headers only: no weight bytes are read); `sluice run` with the
    same flags would load exactly this."""
    spec, layout = p.spec, p.layout
    resident_params = sum(r.numel for r in p.refs.values())
    n_experts = layout.total_experts
    expert_params = n_experts * 3 * spec.hidden_size * spec.moe_intermediate_size
    info = {
        "model_type": p.index.config.get("model_type"),
        "layers": spec.n_layers,
        "moe_layers": len(layout.layers),
        "hidden_size": spec.hidden_size,
        "heads": spec.n_heads,
        "kv_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim,
        "experts": spec.num_experts,
        "top_k": spec.top_k,
        "expert_intermediate_size": spec.moe_intermediate_size,
        "shared_expert_intermediate_size": spec.shared_expert_intermediate_size,
        "vocab_size": spec.vocab_size,
        "expert_layout": layout.kind or "per_expert",
        "dtype": "/".join(layout.format_names),  # the experts' stored format(s)
        "compute_dtype": str(p.dtype).replace("torch.", ""),
        "files": len(p.index.files),
        "params": resident_params + expert_params,
        "resident_params": resident_params,
        "expert_params": expert_params,
        # what the engine holds: resident weights in the compute dtype or, for projections kept in their GGUF
        # blocks, the stored bytes (a lazy embedding table excluded)
        "resident_bytes": p.resident_bytes,
        "expert_bytes_total": n_experts * layout.expert_nbytes,
        "bytes_per_expert": layout.expert_nbytes,
        "expert_bytes_per_token": len(layout.layers) * spec.top_k * layout.expert_nbytes,
        "max_context": p.max_context,
        "prefill_chunk": p.prefill_chunk,
        "prefill_chunk_why": p.prefill_why,
        "prefill_span": p.prefill_span,
        "prefill_bytes": p.prefill_bytes,  # a chunk's activations: the heap keeps this much (host/memory.keep_heap)
        # streamed: a longer prompt's passes grow into expert slots lent while it runs (store/budget.py PromptLoan)
        "prompt_loan": None if p.prompt_loan is None else {
            "widest": p.prompt_loan.widest, "lendable_bytes": p.prompt_loan.lendable, "keep_slots": p.prompt_loan.keep,
            "widest_pass": p.prompt_loan.widest_pass()},
        "prefill_matmul": describe_matmul(p.options.matmul, avx2=p.options.isa != "auto"),
        "activations": p.activations,  # the integer kernels' coding of a projection's input
        "activations_why": p.activations_why,
        "prefetch": p.prefetch,  # a decode token's read-ahead of the next layer's experts
        "prefetch_why": p.prefetch_why,
        "kv_cache_bytes": p.kv_bytes,
        # what one position costs over the layers that keep one: the latent and rope key under latent attention
        # (MLA), else the keys and values of the kv heads; Gated DeltaNet layers keep a fixed-size state instead
        "kv_bytes_per_position": KVCache.position_bytes(spec, p.dtype.itemsize),
        "kv_layers": sum(spec.attends(L) for L in range(spec.n_layers)),
        "state_bytes": KVCache.state_bytes(spec, p.dtype.itemsize),
        "attention": "mla" if spec.mla is not None else "hybrid" if spec.delta is not None else "gqa",
        **({"kv_lora_rank": spec.mla.kv_lora_rank, "qk_rope_head_dim": spec.mla.qk_rope_head_dim}
           if spec.mla is not None else {}),
        "memory_plan": p.describe_memory(),
        "odirect": p.odirect,
        "threads": p.threads,
    }
    if p.budget is not None:
        info.update(memory=p.memory, expert_slots=p.budget.slots, expert_cache_bytes=p.budget.cache_bytes,
                    cached_fraction=round(p.budget.cached_fraction, 4))
    if spec.hc_count > 1:
        info["residual_streams"] = spec.hc_count
    if spec.qsa is not None:
        info["qsa"] = {"heads": spec.qsa.n_heads, "head_dim": spec.qsa.head_dim, "budget": spec.qsa.budget,
                       "compress_ratio": spec.qsa.compress_ratio}
    if p.ple is not None:
        parts = list(p.ple_tables.values())
        info["ple"] = {"mode": p.ple, "why": p.ple_why, "bytes": p.ple_bytes, "layers": [L for L in p.ple_tables],
                       "parts": sum(len(ps) for ps in parts), "rows": sum(spec.ple.rows),
                       "rows_per_token": spec.ple.n_heads * len(parts), "row_bytes": parts[0][0].row_nbytes,
                       "dtype": parts[0][0].dtype}
    return info


def _print(info: dict) -> None:
    fb = format_bytes
    heads = (f"{info['heads']} heads over a latent of {info['kv_lora_rank']} + rope {info['qk_rope_head_dim']} (MLA)"
             if info["attention"] == "mla" else f"{info['heads']} heads / {info['kv_heads']} kv x {info['head_dim']}")
    if info["attention"] == "hybrid":
        heads += f" on {info['kv_layers']} layers, Gated DeltaNet on {info['layers'] - info['kv_layers']}"
    print(f"{info['model_type']}: {info['layers']} layers ({info['moe_layers']} MoE), hidden {info['hidden_size']}, "
          f"{heads}, vocab {info['vocab_size']}")
    print(f"experts: {info['experts']} per layer, top-{info['top_k']}, intermediate "
          f"{info['expert_intermediate_size']}, layout {info['expert_layout']}, dtype {info['dtype']}")
    print(f"params: {info['params'] / 1e9:.3f} B = resident {info['resident_params'] / 1e6:.1f} M + experts "
          f"{info['expert_params'] / 1e6:.1f} M")
    print(f"bytes: resident {fb(info['resident_bytes'])} + experts {fb(info['expert_bytes_total'])} "
          f"({fb(info['bytes_per_expert'])} each)")
    print(f"expert bytes touched per decoded token: {fb(info['expert_bytes_per_token'])}")
    kind = "latent (MLA)" if info["attention"] == "mla" else "keys + values"
    kind += f", {fb(info['kv_bytes_per_position'])} per position"
    if info["attention"] == "hybrid":  # keys and values on the attention layers, a fixed state on the others
        kind += (f" on {info['kv_layers']} of {info['layers']} layers, and the Gated DeltaNet state of the other "
                 f"{info['layers'] - info['kv_layers']}: {fb(info['state_bytes'])}")
    print(f"compute {info['compute_dtype']}, KV cache {fb(info['kv_cache_bytes'])} for {info['max_context']} "
          f"positions ({kind}), {info['threads']} threads, O_DIRECT {'on' if info['odirect'] else 'off'}")
    print(f"prefill: {info['prefill_chunk']} tokens per pass ({info['prefill_chunk_why']}); bf16 rows: "
          f"{info['prefill_matmul']}")
    if (loan := info["prompt_loan"]) is not None:
        print(f"longer prompts: passes of up to {loan['widest_pass']} tokens in expert slots lent while they run "
              f"(up to {fb(loan['lendable_bytes'])}; the store keeps {loan['keep_slots']} slots)")
    print(f"activations: {info['activations']} ({info['activations_why']})")
    print(f"decode read-ahead: {info['prefetch']} ({info['prefetch_why']})")
    if "residual_streams" in info:
        print(f"hyper-connections: {info['residual_streams']} residual streams")
    if "qsa" in info:
        q = info["qsa"]
        print(f"QSA: each query attends to its best {q['budget'] // q['compress_ratio']} blocks of "
              f"{q['compress_ratio']} tokens (budget {q['budget']}) and its tail; indexer {q['heads']} heads x "
              f"{q['head_dim']}")
    if "ple" in info:
        t = info["ple"]
        print(f"n-gram tables (PLE) on layers {t['layers']}: {fb(t['bytes'])} ({t['rows']:,} rows of "
              f"{t['row_bytes']} B, {t['dtype']}, in {t['parts']} parts); {t['rows_per_token']} rows per token "
              f"({fb(t['rows_per_token'] * t['row_bytes'])})")
        print(f"  read: {t['mode']} ({t['why']})")
    print(f"memory: {info['memory_plan']}")
    if "memory" in info:
        print(f"expert cache: {info['expert_slots']} slots = {fb(info['expert_cache_bytes'])} "
              f"({100 * info['cached_fraction']:.1f}% of all experts)")
    if "usage" in info:
        used = info["usage"]["experts_used_per_layer"]
        print(f"expert usage over {info['usage']['tokens']} sample tokens: {min(used)}-{max(used)} of "
              f"{info['experts']} experts per layer ({used})")


def main(args: argparse.Namespace) -> int:
    p = plan(args.model, options_from_args(args))
    info = describe(p)
    if args.usage_tokens > 0:
        with Model(p.path, p.options, progress=not args.json, load_plan=p) as m:
            n = min(args.usage_tokens, m.cache.max_context)
            ids = (m.tokenizer.encode(SAMPLE * 8) if m.tokenizer else list(range(m.spec.vocab_size)))[:n]
            m.logits(ids)
            usage = m.store.usage  # [layers, experts] routing counts
            moe = [i for i, s in enumerate(m.spec.moe_layers) if s]
            info["usage"] = {"tokens": len(ids),
                             "experts_used_per_layer": [int((usage[i] > 0).sum()) for i in moe]}
    if args.json:
        print(json.dumps(info))
    else:
        _print(info)
    return 0
