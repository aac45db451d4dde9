"""The model's structs, as llama2.c has them: `Spec` (the blueprint, from config.json), `Weights` (the resident
tensors, built by the loader) and `KVCache` (run state, allocated once). No math here, so the store and the loaders
can depend on these without depending on the model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .rope import RopeConfig


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
    # act(gate) * up; None: the plain gated activation (models/experts.py glu_for)
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = "none"  # "none" | "head" (Qwen3: per head over head_dim) | "full" (OLMoE: over all heads)
    clip_qkv: float | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"


@dataclass
class MLPWeights:
    """A dense SwiGLU MLP (mlp_only layers, Qwen2-MoE's shared expert): gate/up [I, H], down [H, I]."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


@dataclass
class LayerWeights:
    """Resident weights of one decoder layer. Expert weights live in the ExpertStore, not here."""

    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    q: torch.Tensor  # [nH*D, H]
    k: torch.Tensor  # [nKV*D, H]
    v: torch.Tensor  # [nKV*D, H]
    o: torch.Tensor  # [H, nH*D]
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [D] ("head") or [nH*D] ("full")
    k_norm: torch.Tensor | None = None
    router: torch.Tensor | None = None  # [E, H] on MoE layers
    # [E]: gpt-oss's router bias (added to the logits) or glm4_moe / deepseek_v3's e_score_correction_bias
    # (selection only); loaded in float32 (store/weights.py)
    router_bias: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # [nH] attention sink logits (gpt-oss, Spec.attn_sinks)
    mlp: MLPWeights | None = None  # dense layers
    shared: MLPWeights | None = None  # shared expert(s) beside the routed ones, added to every token
    shared_gate: torch.Tensor | None = None  # [1, H]: Qwen2-MoE scales the shared expert by sigmoid(gate x); None: 1


@dataclass
class Weights:
    """All resident weights: the model's `Weights` struct (llama2.c); built by the loader, never by the math."""

    embed: torch.Tensor | None  # [V, H]; None when rows are read from disk per batch (RowTable)
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H] (the embedding itself when tied)
    layers: list[LayerWeights] = field(default_factory=list)


class KVCache:
    """Keys and values for every layer, allocated once for `max_context` positions and written in place."""

    def __init__(self, spec: Spec, max_context: int, dtype: torch.dtype):
        shape = (spec.n_layers, spec.n_kv_heads, max_context, spec.head_dim)
        # torch.empty: pages are only committed when a position is written, so an unused context costs nothing.
        self.k = torch.empty(shape, dtype=dtype)
        self.v = torch.empty(shape, dtype=dtype)
        self.max_context = max_context

    @property
    def nbytes(self) -> int:
        n_layers, n_kv_heads, max_context, head_dim = self.k.shape
        return self.bytes_for(n_layers, n_kv_heads, head_dim, max_context, self.k.element_size())

    @staticmethod
    def bytes_for(n_layers: int, n_kv_heads: int, head_dim: int, max_context: int, itemsize: int) -> int:
        """Bytes of keys + values for `max_context` positions, without allocating them."""
        return 2 * n_layers * n_kv_heads * max_context * head_dim * itemsize
