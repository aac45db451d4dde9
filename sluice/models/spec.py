"""The model's structs, as llama2.c has them: `Spec` (the blueprint, from config.json), `Weights` (the resident
tensors, built by the loader) and `KVCache` (run state, allocated once). No math here, so the store and the loaders
can depend on these without depending on the model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..quant.linear import QuantLinear
    from .rope import RopeConfig

    Proj = torch.Tensor | QuantLinear  # a projection weight: a QuantLinear when kept in its GGUF blocks


@dataclass
class MLASpec:
    """Multi-head latent attention (deepseek_v3): queries through an optional low-rank q_a/q_b pair, keys and values
    expanded per head from one compressed latent of `kv_lora_rank` plus one rope key of `qk_rope_head_dim` shared by
    every head. The KV cache holds only that latent and rope key per position (`cache_dim`), not the expanded heads."""

    q_lora_rank: int  # 0: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int  # per head: the query/key dims without position
    qk_rope_head_dim: int  # per head: the rotated dims (the key's are shared by all heads)
    v_head_dim: int
    softmax_scale: float  # qk_head_dim^-0.5, times yarn's mscale(factor, mscale_all_dim)^2 when the rope sets it
    rope_interleave: bool  # rotary pairs (x0, x1), (x2, x3) ... instead of the two halves

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Cached values per position and layer: the normed latent, then the roped shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass
class Spec:
    """Everything the math needs to know about an architecture instance, derived from config.json."""

    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    moe_layers: list[bool]  # per layer: sparse MoE (True) or dense MLP (False)
    sliding_window: list[int | None]  # per layer: attention window or None for full causal
    dense_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen2-MoE has one, with a sigmoid gate)
    norm_topk_prob: bool = False
    # Mixtral keeps the top-k weights in float32 and multiplies the expert output by them before casting back;
    # the Qwen/OLMoE routers cast the weights to the compute dtype first. Matters only for bf16/fp16 parity.
    router_weights_fp32: bool = False
    router: str = "softmax"  # the routing family (models/routing.py ROUTERS)
    # "sigmoid_grouped" routers: experts in n_group groups, only the topk_group best groups selectable; the top-k
    # weights are multiplied by routed_scaling_factor
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    attn_sinks: bool = False  # gpt-oss: a learned logit per head joins each query's softmax (LayerWeights.sinks)
    # gpt-oss experts: (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit), instead of
    # act(gate) * up; None: the plain gated activation (models/layers/experts.py glu_for)
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = "none"  # "none" | "head" (Qwen3: per head over head_dim) | "full" (OLMoE: over all heads)
    clip_qkv: float | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    mla: MLASpec | None = None  # multi-head latent attention on every layer (deepseek_v3); None: q/k/v heads (GQA)


@dataclass
class MLPWeights:
    """A dense SwiGLU MLP (mlp_only layers, Qwen2-MoE's shared expert): gate/up [I, H], down [H, I]."""

    gate: Proj
    up: Proj
    down: Proj


@dataclass
class MLAWeights:
    """A latent attention layer's projections (MLASpec): r = kv_lora_rank, R = qk_rope_head_dim, N/V = the
    per-head nope/value dims, Q = q_lora_rank."""

    kv_a: Proj  # [r + R, H] kv_a_proj_with_mqa: the latent and the shared rope key
    kv_a_norm: torch.Tensor  # [r]
    kv_b: torch.Tensor  # [nH*(N+V), r]: per head, N key rows then V value rows
    q: Proj | None = None  # [nH*(N+R), H] when q_lora_rank is 0
    q_a: Proj | None = None  # [Q, H]
    q_a_norm: torch.Tensor | None = None  # [Q]
    q_b: Proj | None = None  # [nH*(N+R), Q]
    q_a_bias: torch.Tensor | None = None  # [Q] (attention_bias)
    kv_a_bias: torch.Tensor | None = None  # [r + R] (attention_bias)


@dataclass
class LayerWeights:
    """Resident weights of one decoder layer. Expert weights live in the ExpertStore, not here."""

    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    o: Proj  # [H, nH*D] ([H, nH*V] under latent attention)
    q: Proj | None = None  # [nH*D, H]; None under latent attention (`mla`)
    k: Proj | None = None  # [nKV*D, H]
    v: Proj | None = None  # [nKV*D, H]
    mla: MLAWeights | None = None
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [D] ("head") or [nH*D] ("full")
    k_norm: torch.Tensor | None = None
    router: torch.Tensor | None = None  # [E, H] on MoE layers
    # [E]: gpt-oss's router bias (added to the logits) or glm4_moe / deepseek_v3's e_score_correction_bias
    # (selection only); loaded in float32 (models/weights.py)
    router_bias: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # [nH] attention sink logits (gpt-oss, Spec.attn_sinks)
    mlp: MLPWeights | None = None  # dense layers
    shared: MLPWeights | None = None  # shared expert(s) beside the routed ones, added to every token
    shared_gate: Proj | None = None  # [1, H]: Qwen2-MoE scales the shared expert by sigmoid(gate x); None: 1


@dataclass
class Weights:
    """All resident weights: the model's `Weights` struct (llama2.c); built by the loader, never by the math."""

    embed: torch.Tensor | None  # [V, H]; None when rows are read from disk per batch (RowTable)
    norm: torch.Tensor  # [H]
    lm_head: Proj  # [V, H] (the embedding itself when tied)
    layers: list[LayerWeights] = field(default_factory=list)


class KVCache:
    """Every layer's cached keys and values, allocated once for `max_context` positions and written in place.

    q/k/v heads: `k` and `v` [layers, nKV, P, D]. Latent attention (spec.mla): `latent` [layers, P, r + R], the normed
    compressed latent then the roped shared key of each position, from which attention expands (or absorbs) the
    heads: 576 values per position and layer for DeepSeek-V3 where expanded keys and values would take 40,960.
    """

    def __init__(self, spec: Spec, max_context: int, dtype: torch.dtype):
        # torch.empty: pages are only committed when a position is written, so an unused context costs nothing.
        self.k = self.v = self.latent = None
        if spec.mla is not None:
            self.latent = torch.empty((spec.n_layers, max_context, spec.mla.cache_dim), dtype=dtype)
        else:
            shape = (spec.n_layers, spec.n_kv_heads, max_context, spec.head_dim)
            self.k = torch.empty(shape, dtype=dtype)
            self.v = torch.empty(shape, dtype=dtype)
        self.max_context = max_context
        self.nbytes = self.bytes_for(spec, max_context, dtype.itemsize)

    @staticmethod
    def values_per_position(spec: Spec) -> int:
        """Cached values of one position in one layer: the latent and rope key (MLA), else keys + values."""
        return spec.mla.cache_dim if spec.mla is not None else 2 * spec.n_kv_heads * spec.head_dim

    @staticmethod
    def bytes_for(spec: Spec, max_context: int, itemsize: int) -> int:
        """Bytes of the cache for `max_context` positions, without allocating them (what the budget plans)."""
        return spec.n_layers * max_context * KVCache.values_per_position(spec) * itemsize
