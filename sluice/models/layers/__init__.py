"""The modules a decoder layer is composed of, one concern each, composed by each architecture file (`layers(b)`):

    build.py      Build (what modules are built from, the model-wide choices), Kernels, Step (one forward pass)
    residual.py   PreNorm: the residual rule, x + mixer(norm(x)), x + ffn(norm(x))
    hyper.py      HyperLayer, Streams: hyper-connections, the residual as several streams mixed into each block
                  (qwen4_exp)
    attention.py  Attention: grouped-query attention over a KV cache (its decode / prompt cores chosen at build)
    sinks.py      attention sinks (gpt-oss), a core of Attention
    mla.py        LatentAttention: multi-head latent attention over a latent cache (deepseek_v3)
    gated_attention.py  GatedAttention: Attention with a sigmoid output gate from q_proj (qwen3_next, qwen3_5_moe)
    gated_deltanet.py   GatedDeltaNet: linear attention over a fixed-size conv + recurrent state (the same)
    qsa.py        IndexedAttention: gated attention over the keys an indexer picks per query (qwen4_exp)
    ple.py        PLE: per-layer embeddings of hashed n-grams, rows of a large table read per pass (qwen4_exp)
    delta_rule.py the gated delta rule, chunked (prompts) and recurrent (decode)
    moe.py        MoE: router, the routed experts from the store, the shared expert
    dense.py      DenseMLP: a dense gated MLP (dense layers, shared experts)
    experts.py    the experts' math per stored format (GluMath, BiasedGluMath)
    norm.py       rms_norm, Norm (plain or zero-centred), gated_rms_norm

A new layer kind is a new module here plus the architecture that composes it, and their tests.
"""

from __future__ import annotations

from .attention import Attention
from .build import Build, Kernels, Step
from .dense import DenseMLP, dense_mlp
from .gated_attention import GatedAttention
from .gated_deltanet import GatedDeltaNet
from .hyper import HyperLayer
from .mla import LatentAttention
from .moe import MoE, moe_block
from .ple import PLE
from .qsa import IndexedAttention
from .residual import PreNorm


def moe_or_dense(b: Build, L: int):
    """Layer L's feed-forward block: the MoE block on a sparse layer (moe_layers), else its dense MLP."""
    return moe_block(b, L) if b.spec.moe_layers[L] else dense_mlp(b, L)


__all__ = ["Attention", "Build", "DenseMLP", "GatedAttention", "GatedDeltaNet", "HyperLayer", "IndexedAttention",
           "Kernels", "LatentAttention", "MoE", "PLE", "PreNorm", "Step", "dense_mlp", "moe_block", "moe_or_dense"]
