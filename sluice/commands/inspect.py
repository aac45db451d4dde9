"""`sluice inspect MODEL [--memory SIZE]`: architecture, parameter and byte split, per-token expert traffic, what
a budget leaves for the expert cache, and expert usage on a sample prompt."""

from __future__ import annotations

import argparse
import json

import torch

from ..checkpoint.index import CONFIG, CheckpointIndex
from ..models import model_args
from ..models.spec import KVCache
from ..options import LoadOptions, format_bytes
from ..errors import BudgetError
from ..store.budget import auto_memory, plan_budget
from ..host.memory import available_memory
from ..store.layout import ExpertLayout
from ..store.weights import resident_refs
from .common import add_model_arguments, load_from_args

SAMPLE = "The quick brown fox jumps over the lazy dog. In the beginning was the word, and the word was with God."


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--usage-tokens", type=int, default=32, metavar="N",
                   help="route N tokens of a sample prompt and report experts used per layer (0 = skip)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def describe(folder: str, memory: int | str | None = None, max_context: int = 4096) -> dict:
    """Everything `inspect` reports that needs only the headers (no weight bytes are read). `memory` as --memory
    takes it (bytes, "auto", or None = resident); "auto" reports what `sluice run` would choose here."""
    index = CheckpointIndex.open(folder)
    arch, args = model_args(index.config, index.folder / CONFIG)
    spec = args.spec()
    layout = ExpertLayout(index, spec, arch)
    refs = resident_refs(index, spec, arch)
    resident_params = sum(r.numel for r in refs.values())
    # what the engine holds: resident weights in the compute dtype (a quantized checkpoint's dequantized to bf16)
    itemsize = (layout.plain_dtype or torch.bfloat16).itemsize
    resident_bytes = resident_params * itemsize
    moe_layers = len(layout.layers)
    n_experts = layout.total_experts
    expert_params = n_experts * 3 * spec.hidden_size * spec.moe_intermediate_size
    info = {
        "model_type": index.config.get("model_type"),
        "layers": spec.n_layers,
        "moe_layers": moe_layers,
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
        "dtype": "/".join(layout.format_names),
        "files": len(index.files),
        "params": resident_params + expert_params,
        "resident_params": resident_params,
        "expert_params": expert_params,
        "resident_bytes": resident_bytes,
        "expert_bytes_total": n_experts * layout.expert_nbytes,
        "bytes_per_expert": layout.expert_nbytes,
        "expert_bytes_per_token": moe_layers * spec.top_k * layout.expert_nbytes,
    }
    if memory == "auto":
        kv_bytes = KVCache.bytes_for(spec.n_layers, spec.n_kv_heads, spec.head_dim,
                                     min(max_context, spec.rope.max_position_embeddings), itemsize)
        room = available_memory()
        try:
            auto = auto_memory(room.bytes, room.source, resident_bytes, layout.expert_nbytes, n_experts, spec.top_k,
                               kv_bytes)
            info["memory_plan"], memory = auto.describe(), auto.memory
        except BudgetError as e:
            info["memory_plan"], memory = f"auto: {e}", None
    if memory is not None:
        plan = plan_budget(memory, resident_bytes, layout.expert_nbytes, spec.top_k, n_experts)
        info.update(memory=memory, expert_slots=plan.slots, expert_cache_bytes=plan.cache_bytes,
                    cached_fraction=round(plan.cached_fraction, 4))
    return info


def _print(info: dict) -> None:
    fb = format_bytes
    print(f"{info['model_type']}: {info['layers']} layers ({info['moe_layers']} MoE), hidden {info['hidden_size']}, "
          f"{info['heads']} heads / {info['kv_heads']} kv x {info['head_dim']}, vocab {info['vocab_size']}")
    print(f"experts: {info['experts']} per layer, top-{info['top_k']}, intermediate "
          f"{info['expert_intermediate_size']}, layout {info['expert_layout']}, dtype {info['dtype']}")
    print(f"params: {info['params'] / 1e9:.3f} B = resident {info['resident_params'] / 1e6:.1f} M + experts "
          f"{info['expert_params'] / 1e6:.1f} M")
    print(f"bytes: resident {fb(info['resident_bytes'])} + experts {fb(info['expert_bytes_total'])} "
          f"({fb(info['bytes_per_expert'])} each)")
    print(f"expert bytes touched per decoded token: {fb(info['expert_bytes_per_token'])}")
    if "memory_plan" in info:
        print(f"--memory {info['memory_plan']}")
    if "memory" in info:
        print(f"--memory {fb(info['memory'])}: {info['expert_slots']} expert slots = {fb(info['expert_cache_bytes'])}"
              f" ({100 * info['cached_fraction']:.1f}% of all experts)")
    if "usage" in info:
        used = info["usage"]["experts_used_per_layer"]
        print(f"expert usage over {info['usage']['tokens']} sample tokens: {min(used)}-{max(used)} of "
              f"{info['experts']} experts per layer ({used})")


def main(args: argparse.Namespace) -> int:
    info = describe(args.model, LoadOptions.make(memory=args.memory).memory, args.max_context)
    if args.usage_tokens > 0:
        with load_from_args(args, progress=not args.json) as m:
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
