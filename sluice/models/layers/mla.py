"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2: `Spec.mla`), over a KV cache of compressed latents.

Per position, kv_a_proj_with_mqa gives a latent c [r] (RMS-normed) and one rope key k_R [R] shared by all heads;
kv_b_proj expands c into each head's key part k_N [N] and value [V]. The cache keeps [c; rope(k_R)] per position
(`LayerCache.latent`, r + R values), as transformers' cache does, never the expanded heads. Two exact forms:

- absorbed: q_N . k_N = (W_UK^T q_N) . c, so each query moves into latent space and attends over the cached rows
  themselves as one key/value head shared by all heads (keys [c; k_R], values c); the output is W_UV times the
  attended latent. Nothing is expanded per position: T (2r + R) multiply-adds per cached position and head.
- expanded: kv_b over every cached latent, then ordinary attention with keys [k_N; k_R] (the reference's order of
  operations): r (N + V) + T (N + R + V) per cached position and head, so it wins for long chunks.
`absorbs` picks the cheaper by that count (at DeepSeek-V3's shapes absorbed up to T = 170) unless the expanded
heads would not fit ATTN_ROOM (beyond ~450 cached positions at DeepSeek-V3's 128 heads in bf16), then absorbs too.
TODO: expand in blocks of positions with an online softmax, so long prompts keep the expanded form's speed. Measured on this
machine's shared 2 cores (1 thread, float32, DeepSeek-V3's head shapes with 16 heads; bf16 in brackets): decode
(T = 1) over 1024 cached positions 10 ms absorbed vs 108 ms expanded (49 vs 1371), over 4096 20 vs 812 ms; a
prefill chunk of T = 256 over 1024 positions 710 vs 406 ms (11162 vs 2834: bf16 matmuls on AVX2 favour expansion
from T ~ 64 already). Both forms agree within float rounding; bitwise equality holds only within one form, so a
prompt whose last token is recomputed alone (the engine's prefix reuse) matches a fresh prefill bitwise only when
both chunks take the same form (every chunk up to T = 170 at DeepSeek-V3's shapes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...quant.native import BEST
from ..linear import linear
from ..rope import apply_rope
from ..spec import LayerWeights, MLASpec
from .build import Build, Step
from .norm import rms_norm

# q_a_layernorm / kv_a_layernorm: transformers (and DeepSeek's reference code) build them with RMSNorm's default eps,
# not config.json's rms_norm_eps
LORA_NORM_EPS = 1e-6


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, R] rotated in interleaved pairs (x0, x1), (x2, x3), ... by cos/sin [T, R] (cat(freqs, freqs)
    tables); the output holds the pairs' first elements, then their second ones -- transformers'
    apply_rotary_pos_emb_interleave, op for op, so the results are bitwise its own."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


#: transient bytes one attention call may take beyond the cache (the budget's PREFILL_ROOM, store/budget.py): the
#: expanded form's per-position heads (DeepSeek-V3: 112 KiB a position in bf16, 3.5 GiB over 32K positions) are only
#: built below it, and the absorbed form's [nH, T, S] scores are computed for as many queries at a time as fit
ATTN_ROOM = 64 * 2**20
SCORE_BYTES = 12  # per score of the absorbed form: float32 scores, their masked copy, the probabilities


def absorbs(m: MLASpec, n_heads: int, T: int, S: int, itemsize: int) -> bool:
    """Whether T new queries over S positions attend in the absorbed form: per position and head it costs T (2r + R)
    multiply-adds, the expanded form r (N + V) (kv_b on the position, once per call) + T (N + R + V); the expanded
    form is also refused when its S x heads keys and values would not fit ATTN_ROOM."""
    r, N, R, V = m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    if S * n_heads * (2 * N + R + V) * itemsize > ATTN_ROOM:
        return True
    return T * (2 * r + R) <= r * (N + V) + T * (N + R + V)


def _absorbed(m: MLASpec, q_nope: torch.Tensor, q_rot: torch.Tensor, seen: torch.Tensor, kv_b: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
    """q_nope [nH, T, N], q_rot [nH, T, R] over the cached rows seen [S, r + R] -> [nH, T, V], kv_b [nH, N + V, r]
    moved into the query and the output; queries in blocks whose scores fit ATTN_ROOM."""
    nH, T, N = q_nope.shape
    S, r = seen.shape[0], m.kv_lora_rank
    q_lat = torch.matmul(q_nope, kv_b[:, :N])  # [nH, T, r]
    qc = torch.cat((q_lat, q_rot), dim=-1)  # [nH, T, r + R]: one key head for all, heads fold into GEMM rows
    o_lat = torch.empty_like(q_lat)  # [nH, T, r]
    step = max(1, ATTN_ROOM // (SCORE_BYTES * nH * S))
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        scores = torch.matmul(qc[:, t0:t1], seen.T) * m.softmax_scale  # [nH, t, S]
        if mask is not None:
            scores = scores.masked_fill(~mask[t0:t1], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(seen.dtype)
        o_lat[:, t0:t1] = torch.matmul(probs, seen[:, :r])  # [nH, t, r]
    return torch.matmul(o_lat, kv_b[:, N:].transpose(1, 2))  # [nH, T, V]


def _expanded(m: MLASpec, q_nope: torch.Tensor, q_rot: torch.Tensor, seen: torch.Tensor, kv_b: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
    """The same attention with every seen position's heads built: keys [k_N; k_R], values V -> [nH, T, V]."""
    nH, T, N = q_nope.shape
    S, r, R = seen.shape[0], m.kv_lora_rank, m.qk_rope_head_dim
    kv = F.linear(seen[:, :r], kv_b.reshape(-1, r)).view(S, nH, -1).transpose(0, 1)  # [nH, S, N+V]
    k = torch.cat((kv[..., :N], seen[None, :, r:].expand(nH, S, R)), dim=-1)  # [nH, S, N+R]
    qf = torch.cat((q_nope, q_rot), dim=-1)  # [nH, T, N+R]
    return F.scaled_dot_product_attention(qf[None], k[None], kv[None, ..., N:], attn_mask=mask,
                                          scale=m.softmax_scale)[0]  # [nH, T, V]


def latent_attention(m: MLASpec, n_heads: int, lw: LayerWeights, x: torch.Tensor, cache: torch.Tensor, pos: int,
                     mask: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                     absorb: bool | None = None, bf16: bool = False, path: int = BEST) -> torch.Tensor:
    """One latent attention layer on x [T, H] at positions pos..pos+T-1 -> [T, H]; writes the latent and rope key
    of the T positions into `cache` [P, r + R] (this layer's LayerCache.latent). `mask` [T, pos+T] (True =
    attend) or None; cos/sin [T, R] for these positions. `absorb`: the form to use (None: `absorbs` decides).
    bf16 / path: the model's Compute.bf16_gemm / Compute.path."""
    w = lw.mla
    T, nH = x.shape[0], n_heads
    N, R, V, r = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    if w.q is not None:
        q = linear(x, w.q, None, bf16)  # [T, nH*(N+R)]
    else:
        q = linear(rms_norm(linear(x, w.q_a, w.q_a_bias, bf16), w.q_a_norm, LORA_NORM_EPS, path), w.q_b, None, bf16)
    q_nope, q_rot = q.view(T, nH, N + R).transpose(0, 1).split([N, R], dim=-1)  # [nH, T, N], [nH, T, R]
    latent, k_rot = linear(x, w.kv_a, w.kv_a_bias, bf16).split([r, R], dim=-1)  # [T, r], [T, R]
    rotate = rope_interleaved if m.rope_interleave else (lambda t, c, s_: apply_rope(t, c, s_, path))
    q_rot, k_rot = rotate(q_rot, cos, sin), rotate(k_rot[None], cos, sin)[0]
    cache[pos : pos + T, :r] = rms_norm(latent, w.kv_a_norm, LORA_NORM_EPS, path)
    cache[pos : pos + T, r:] = k_rot
    seen = cache[: pos + T]  # [S, r + R]
    if absorb is None:
        absorb = absorbs(m, nH, T, pos + T, x.element_size())
    out = (_absorbed if absorb else _expanded)(m, q_nope, q_rot, seen, w.kv_b.view(nH, N + V, r), mask)
    return linear(out.transpose(0, 1).reshape(T, nH * V), lw.o, lw.o_bias, bf16)


class LatentAttention:
    """The latent attention mixer of layer L (Spec.mla): x [T, H] -> [T, H] over its LayerCache.latent."""

    def __init__(self, b: Build, L: int):
        s, c = b.spec, b.compute
        self.m, self.n_heads, self.lw, self.window = s.mla, s.n_heads, b.w.layers[L], s.sliding_window[L]
        self.cache, self.cos, self.sin = b.cache.layers[L].latent, b.cos, b.sin
        self.bf16, self.path = c.bf16_gemm, c.path

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        pos, T = step.pos, x.shape[0]
        return latent_attention(self.m, self.n_heads, self.lw, x, self.cache, pos, step.mask(self.window),
                                self.cos[pos : pos + T], self.sin[pos : pos + T], bf16=self.bf16, path=self.path)
