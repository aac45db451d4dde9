"""The model's structs, as llama2.c has them: `Spec` (the blueprint, from config.json), `Weights` (the resident
tensors, built by the loader) and `KVCache` (run state, allocated once: each layer's `LayerCache`). No math here, so
the store and the loaders can depend on these without depending on the model code.
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
    kv_b_split: bool = False  # kv_b stored as llama.cpp's k_b [nH, r, N] and v_b [nH, V, r] (joined at load)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Cached values per position and layer: the normed latent, then the roped shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


DELTA_CHUNK = 64  # tokens per block of the chunked delta rule (models/layers/delta_rule.py; the reference's)
# Prompt tokens a Gated DeltaNet layer takes at once (layers/gated_deltanet.py): a longer pass runs in slices of this
# many, the states carried, so the rule's float32 blocks (~240 KB a token at Qwen3.5's shapes) are bounded by the
# slice and not by the prefill chunk, which the MoE's expert reads want long (a streamed layer reads its experts once
# per chunk). A whole number of DELTA_CHUNK blocks: a slice boundary is a block boundary, the same blocks as one pass.
DELTA_SLICE = 256


@dataclass
class DeltaNetSpec:
    """Gated DeltaNet linear attention (qwen3_next, qwen3_5_moe) on the layers `layers` marks; the others attend.

    Per layer a depthwise causal conv of `conv_kernel` taps over q | k | v (conv_dim channels), then the gated delta
    rule (models/layers/delta_rule.py) with one [k_head_dim, v_head_dim] float32 state per value head. Fewer key
    heads than value heads: each key head serves n_v_heads / n_k_heads value heads. Its state is the same size
    whatever the context: nothing per position (LayerCache.conv, .recurrent)."""

    layers: list[bool]  # per layer: Gated DeltaNet (True) or full attention (False)
    n_k_heads: int
    n_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    # the output norm's gate: rms_norm(o) * weight * act(z); "silu" (Qwen3-Next, Qwen3.5) or "sigmoid" (Qwen4-Exp's
    # output_gate_type)
    gate_act: str = "silu"
    # value heads stored tiled over the key heads (value head j reads key head j % n_k_heads: llama.cpp's qwen35
    # GGUFs) instead of grouped by key head (j // (n_v_heads / n_k_heads): transformers'); models/layers/
    # gated_deltanet.py runs the heads in the stored order
    tiled: bool = False
    # the input projections the checkpoint stores, as DeltaNetWeights roles: ("qkv", "z", "b", "a") (Qwen3.5),
    # ("qkvz", "ba") (Qwen3-Next), ("qkv", "z", "ba") (llama.cpp's qwen3next)
    projections: tuple[str, ...] = ("qkv", "z", "b", "a")

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    def state_bytes(self, itemsize: int) -> int:
        """Bytes of one layer's state: the conv's last conv_kernel - 1 inputs (compute dtype) and the delta rule's
        float32 state."""
        state = self.n_v_heads * self.k_head_dim * self.v_head_dim
        return self.conv_dim * (self.conv_kernel - 1) * itemsize + 4 * state

    def prompt_bytes_per_token(self, itemsize: int, native: bool = False) -> int:
        """Live bytes one prompt token costs in a layer at its peak. The torch steps: the projections and the conv's
        input and output (compute dtype), and the chunked rule's float32 blocks per value head: q, k, v, their
        beta-scaled and decayed copies, the two solves' outputs, the output (6 Dk + 4 Dv) and the token's rows of the
        [C, C] decay, in-block and score matrices (3 C). native (the conv and the rule in native calls, whose blocks
        live in per-thread scratch): the conv's output and the rule's (compute dtype) and the gated norm's float32
        temporaries (4 Dv a value head). At Qwen3.5's shapes, bf16: 232 / 88 KiB; measured (peak RSS growth over a
        slice, `benchmarks/results/hybrid/delta_prompt_memory.py`, 3 processes each, two runs) 207-296 / 79-104 KiB."""
        if native:
            return itemsize * (self.conv_dim + self.value_dim) + 4 * 4 * self.value_dim
        floats = self.n_v_heads * (6 * self.k_head_dim + 4 * self.v_head_dim + 3 * DELTA_CHUNK)
        return 4 * floats + 2 * itemsize * (self.conv_dim + self.value_dim)

    def prompt_slice_bytes(self, itemsize: int, native: bool = False) -> int:
        """Live bytes of a layer's prompt slice at its peak (DELTA_SLICE tokens: a pass of any length)."""
        return DELTA_SLICE * self.prompt_bytes_per_token(itemsize, native)


@dataclass
class QSASpec:
    """QSA indexed attention (qwen4_exp's full-attention layers, models/layers/qsa.py): an indexer scores blocks of
    `compress_ratio` keys for each query (its `n_heads` query heads and one key head of `head_dim` each), and the
    query attends only to the best `budget / compress_ratio` complete blocks plus the incomplete tail. The cache
    keeps each position's raw indexer key (`head_dim` values) beside the keys and values."""

    n_heads: int
    head_dim: int
    budget: int  # tokens: a query keeps at most this many from complete blocks
    compress_ratio: int  # tokens pooled into one scored block
    # the checkpoint stores the indexer's projection as two, the queries' and the key's (llama.cpp's indexer.q_proj
    # and indexer.k_proj), not transformers' one index_qk_proj
    split: bool = False

    @property
    def block_topk(self) -> int:
        return self.budget // self.compress_ratio


@dataclass
class PLESpec:
    """Per-layer embeddings of hashed n-grams (qwen4_exp, models/layers/ple.py): on each layer of `layers`, every
    token looks up one row per n-gram head (orders 2..ngram_size, `heads_per_ngram` heads each) in that layer's
    table, `head_dim` values each, and a gated block adds them to the residual streams. Each head hashes into its own
    prime-sized part of the table (`head_sizes`, at `offsets`); the hash multiplies the n-gram's token ids by
    `multipliers`. The numbers come from config.json through models/ngram.py, per PLE layer in `layers` order.

    `table`: the checkpoint name of layer L's table (`{layer}` in it), stored whole (`{table}.weight`) or, as the hub
    ships it, in parts `{table}.shard_K.weight` that stack along rows (models/tables.py reads either). `hashes`:
    the names of the hash's buffers transformers saves beside it (role -> name with `{layer}`), checked at load
    when present."""

    layers: list[int]  # decoder layers (0-based) with a PLE block
    ngram_size: int
    heads_per_ngram: int
    embed_dim: int  # all heads' rows side by side
    conv_kernel: int  # the depthwise conv's taps, dilated by ngram_size
    eos_token_id: int  # n-grams do not reach back across it; the context before a prompt is this id
    head_sizes: list[list[int]]
    offsets: list[list[int]]
    multipliers: list[list[int]]
    rows: list[int]  # the table's rows (the heads' sizes summed, padded)
    table: str
    hashes: dict[str, str] = field(default_factory=dict)

    @property
    def n_heads(self) -> int:
        """Rows each token reads per PLE layer."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.n_heads

    @property
    def context(self) -> int:
        """Token ids a decode step needs from before it (an n-gram's earlier tokens)."""
        return self.ngram_size - 1

    @property
    def conv_state(self) -> int:
        """Inputs the dilated conv keeps from before a pass."""
        return (self.conv_kernel - 1) * self.ngram_size

    def index(self, layer: int) -> int:
        """Layer `layer`'s place among the PLE layers (its hash numbers and table)."""
        return self.layers.index(layer)


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
    delta: DeltaNetSpec | None = None  # Gated DeltaNet on the layers it marks (qwen3_next, qwen3_5_moe); None: none
    # q_proj gives each head its queries and as many gate values: attention out * sigmoid(gate) (qwen3_next's
    # gated attention, models/layers/gated_attention.py)
    attn_gate: bool = False
    # RMSNorm weights stored zero-centred: the scale is 1 + weight, applied in float32 before the cast back
    # (qwen3_next, qwen3_5_moe: input / post-attention / final / q / k norms; not their gated norm)
    zero_centred_norms: bool = False
    # hyper-connections (qwen4_exp, models/layers/hyper.py): the residual is hc_count streams of hidden_size, mixed
    # into each block's input through a rank-hc_lowrank mixer; 1: the plain residual (PreNorm)
    hc_count: int = 1
    hc_lowrank: int = 0
    final_norm: bool = True  # model.norm before the head (hyper-connections end in their final mixer instead)
    qsa: QSASpec | None = None  # indexed attention on the attending layers (qwen4_exp); None: plain
    ple: PLESpec | None = None  # per-layer n-gram embeddings (qwen4_exp); None: none

    def attends(self, layer: int) -> bool:
        """Whether `layer` attends over a KV cache (full attention or latent), not Gated DeltaNet."""
        return self.delta is None or not self.delta.layers[layer]


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
class DeltaNetWeights:
    """A Gated DeltaNet layer's weights (DeltaNetSpec; the output projection is LayerWeights.o). The input
    projections (DeltaNetSpec.projections) are Qwen3.5's four (qkv, z, b, a), Qwen3-Next's two fused ones (qkvz, ba),
    whose rows go key head by key head: per key head its q, k, then its value heads' v and z (qkvz), its value
    heads' b then a (ba), or a mix (llama.cpp's qwen3next: qkv, z, ba)."""

    conv: torch.Tensor  # [conv_dim, 1, K] the depthwise causal conv over q | k | v, as stored (compute dtype)
    A_log: torch.Tensor  # [Hv] float32: the decay rate is -exp(A_log)
    dt_bias: torch.Tensor  # [Hv] float32
    norm: torch.Tensor  # [Dv] the gated RMSNorm's weight (a plain scale, not zero-centred)
    qkv: Proj | None = None  # [2 key_dim + value_dim, H]
    z: Proj | None = None  # [value_dim, H] the output gate
    b: Proj | None = None  # [Hv, H] beta = sigmoid(b)
    a: Proj | None = None  # [Hv, H] the decay's input
    qkvz: Proj | None = None  # [2 key_dim + 2 value_dim, H] (qwen3_next)
    ba: Proj | None = None  # [2 Hv, H] (qwen3_next)


@dataclass
class HyperWeights:
    """One hyper-connection (Spec.hc_count streams of H): the streams' grouped norm, the low-rank mixer of the block
    input, and (not on the final mixer) the weights that inject the block's output back into each stream."""

    norm: torch.Tensor  # [n*H], zero-centred, per stream
    down: Proj  # [r, n*H]
    up: Proj  # [n*H, r]
    inject: Proj | None = None  # [n, n*H]


@dataclass
class IndexerWeights:
    """QSA's indexer (QSASpec): one projection for its query heads and its key head (or one each: QSASpec.split),
    their RMSNorms."""

    q_norm: torch.Tensor  # [head_dim]
    k_norm: torch.Tensor  # [head_dim]
    qk: Proj | None = None  # [(n_heads + 1) * head_dim, H]: the queries, then the key
    q: Proj | None = None  # [n_heads * head_dim, H] (split)
    k: Proj | None = None  # [head_dim, H] (split)


@dataclass
class PLEWeights:
    """A PLE block's resident weights (PLESpec; its table is read by rows, models/tables.py): E = embed_dim."""

    key: Proj  # [n*H, E]
    value: Proj  # [H, E]
    norm_key: torch.Tensor  # [n*H], zero-centred, per stream
    norm_query: torch.Tensor  # [n*H]
    norm_conv: torch.Tensor  # [n*H]
    conv: torch.Tensor  # [n*H, 1, conv_kernel] the dilated depthwise conv


@dataclass
class LayerWeights:
    """Resident weights of one decoder layer. Expert weights live in the ExpertStore, not here."""

    o: Proj  # [H, nH*D] ([H, nH*V] under latent attention, [H, value_dim] the out_proj of a Gated DeltaNet)
    input_norm: torch.Tensor | None = None  # [H]; None under hyper-connections (their norms instead)
    post_norm: torch.Tensor | None = None  # [H]
    q: Proj | None = None  # [nH*D, H] ([2*nH*D, H] with attn_gate); None under latent attention and Gated DeltaNet
    k: Proj | None = None  # [nKV*D, H]
    v: Proj | None = None  # [nKV*D, H]
    mla: MLAWeights | None = None
    delta: DeltaNetWeights | None = None  # a Gated DeltaNet layer (Spec.delta)
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
    hc_attn: HyperWeights | None = None  # hyper-connections into the mixer and into the feed-forward block
    hc_mlp: HyperWeights | None = None
    indexer: IndexerWeights | None = None  # QSA (Spec.qsa) on an attending layer
    ple: PLEWeights | None = None  # a PLE block (Spec.ple) before the layer


@dataclass
class Weights:
    """All resident weights: the model's `Weights` struct (llama2.c); built by the loader, never by the math."""

    embed: torch.Tensor | None  # [V, H]; None when rows are read from disk per batch (RowTable)
    norm: torch.Tensor | None  # [H]; None without a final norm (Spec.final_norm)
    lm_head: Proj  # [V, H] (the embedding itself when tied)
    layers: list[LayerWeights] = field(default_factory=list)
    hc_mixer: HyperWeights | None = None  # hyper-connections: the streams' final mix before the head


@dataclass
class LayerCache:
    """One layer's run state, allocated once and written in place: what its mixer keeps between forward passes."""

    k: torch.Tensor | None = None  # [nKV, P, D] attention's keys
    v: torch.Tensor | None = None  # [nKV, P, D] and values
    latent: torch.Tensor | None = None  # [P, r + R] latent attention (MLA): the normed latent, then the roped key
    conv: torch.Tensor | None = None  # [conv_dim, K - 1] Gated DeltaNet: the conv's last K - 1 inputs
    recurrent: torch.Tensor | None = None  # [Hv, Dk, Dv] float32: the delta rule's state
    index_keys: torch.Tensor | None = None  # [P, Di] QSA: each position's raw indexer key
    ple_ids: torch.Tensor | None = None  # [ngram_size - 1] int64 PLE: the last token ids before the next pass
    ple_conv: torch.Tensor | None = None  # [n*H, (K - 1) * ngram_size] PLE: its dilated conv's last inputs
    # Gated DeltaNet: the tokens its conv and recurrent state have absorbed. Unlike keys and values, that state
    # cannot be cut back to an earlier position: a pass must start at 0 (from zeros) or exactly here
    pos: int = 0


class KVCache:
    """Every layer's state (`layers[L]`, a LayerCache), allocated once for `max_context` positions.

    Per position: attention layers keep keys and values (nKV x D each); latent attention (spec.mla) the normed
    compressed latent and the roped shared key of each position, from which attention expands (or absorbs) the
    heads: 576 values per position and layer for DeepSeek-V3 where expanded keys and values would take 40,960.
    Per layer, whatever the context: a Gated DeltaNet layer (spec.delta) its conv inputs and float32 recurrent
    state (Qwen3.5-35B-A3B: 2 MiB each on 30 of its 40 layers; keys and values only on the other 10). QSA layers
    (spec.qsa) keep each position's indexer key too; PLE layers (spec.ple) their last token ids and conv inputs.
    """

    def __init__(self, spec: Spec, max_context: int, dtype: torch.dtype):
        # torch.empty: pages are only committed when a position is written, so an unused context costs nothing; a
        # Gated DeltaNet layer zeroes its state when a pass starts at position 0
        self.layers: list[LayerCache] = []
        for L in range(spec.n_layers):
            c = LayerCache()
            if spec.mla is not None:
                c.latent = torch.empty((max_context, spec.mla.cache_dim), dtype=dtype)
            elif spec.attends(L):
                c.k = torch.empty((spec.n_kv_heads, max_context, spec.head_dim), dtype=dtype)
                c.v = torch.empty((spec.n_kv_heads, max_context, spec.head_dim), dtype=dtype)
                if spec.qsa is not None:
                    c.index_keys = torch.empty((max_context, spec.qsa.head_dim), dtype=dtype)
            else:
                d = spec.delta
                c.conv = torch.empty((d.conv_dim, d.conv_kernel - 1), dtype=dtype)
                c.recurrent = torch.empty((d.n_v_heads, d.k_head_dim, d.v_head_dim), dtype=torch.float32)
            if spec.ple is not None and L in spec.ple.layers:
                c.ple_ids = torch.empty(spec.ple.context, dtype=torch.int64)
                c.ple_conv = torch.empty((spec.hc_count * spec.hidden_size, spec.ple.conv_state), dtype=dtype)
            self.layers.append(c)
        self.max_context = max_context
        self.nbytes = self.bytes_for(spec, max_context, dtype.itemsize)

    @property
    def rewinds(self) -> bool:
        """Whether the state at an earlier position can be recovered by cutting the cache back (keys, values and
        latents: yes; a Gated DeltaNet state: no): what the engine's prompt reuse may assume."""
        return all(c.recurrent is None for c in self.layers)

    @staticmethod
    def position_bytes(spec: Spec, itemsize: int) -> int:
        """Bytes one position costs over all layers: the latent and rope key (MLA), else keys + values of the
        layers that attend."""
        per_layer = spec.mla.cache_dim if spec.mla is not None else 2 * spec.n_kv_heads * spec.head_dim
        if spec.qsa is not None:
            per_layer += spec.qsa.head_dim  # the raw indexer key
        return sum(spec.attends(L) for L in range(spec.n_layers)) * per_layer * itemsize

    @staticmethod
    def state_bytes(spec: Spec, itemsize: int) -> int:
        """Bytes of the per-layer state that does not grow with the context (Gated DeltaNet layers, PLE blocks)."""
        ple = 0 if spec.ple is None else len(spec.ple.layers) * (
            8 * spec.ple.context + spec.hc_count * spec.hidden_size * spec.ple.conv_state * itemsize)
        if spec.delta is None:
            return ple
        return sum(spec.delta.layers) * spec.delta.state_bytes(itemsize) + ple

    @staticmethod
    def bytes_for(spec: Spec, max_context: int, itemsize: int) -> int:
        """Bytes of the cache for `max_context` positions, without allocating them (what the budget plans)."""
        return max_context * KVCache.position_bytes(spec, itemsize) + KVCache.state_bytes(spec, itemsize)
