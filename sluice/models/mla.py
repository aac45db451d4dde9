"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2: `Spec.mla`), over a KV cache of compressed latents.

Per position, kv_a_proj_with_mqa gives a latent c [r] (RMS-normed) and one rope key k_R [R] shared by all heads;
kv_b_proj expands c into each head's key part k_N [N] and value [V]. The cache keeps [c; rope(k_R)] per position
(`KVCache.latent`, r + R values), as transformers' cache does, never the expanded heads. Two exact forms:

- absorbed: q_N . k_N = (W_UK^T q_N) . c, so each query moves into latent space and attends over the cached rows
  themselves as one key/value head shared by all heads (keys [c; k_R], values c); the output is W_UV times the
  attended latent. Nothing is expanded per position: T (2r + R) multiply-adds per cached position and head.
- expanded: kv_b over every cached latent, then ordinary attention with keys [k_N; k_R] (the reference's order of
  operations): r (N + V) + T (N + R + V) per cached position and head, so it wins for long chunks.
`absorbs` picks the cheaper by that count (at DeepSeek-V3's shapes absorbed up to T = 170). Measured on this
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

from . import blocks  # its rms_norm (blocks imports this module: modules, not names, are imported)
from .rope import apply_rope
from .spec import LayerWeights, MLASpec

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


def absorbs(m: MLASpec, T: int) -> bool:
    """Whether T new queries attend in the absorbed form: per cached position and head it costs T (2r + R)
    multiply-adds, the expanded form r (N + V) (kv_b on the position, once per call) + T (N + R + V)."""
    r = m.kv_lora_rank
    return T * (2 * r + m.qk_rope_head_dim) <= r * (m.qk_nope_head_dim + m.v_head_dim) + T * (
        m.qk_head_dim + m.v_head_dim)


def latent_attention(m: MLASpec, n_heads: int, lw: LayerWeights, x: torch.Tensor, cache: torch.Tensor, pos: int,
                     mask: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                     absorb: bool | None = None) -> torch.Tensor:
    """One latent attention layer on x [T, H] at positions pos..pos+T-1 -> [T, H]; writes the latent and rope key
    of the T positions into `cache` [P, r + R] (this layer's slice of KVCache.latent). `mask` [T, pos+T] (True =
    attend) or None; cos/sin [T, R] for these positions. `absorb`: the form to use (None: the cheaper, `absorbs`)."""
    w = lw.mla
    T, nH = x.shape[0], n_heads
    N, R, V, r = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    if w.q is not None:
        q = F.linear(x, w.q)  # [T, nH*(N+R)]
    else:
        q = F.linear(blocks.rms_norm(F.linear(x, w.q_a, w.q_a_bias), w.q_a_norm, LORA_NORM_EPS), w.q_b)
    q_nope, q_rot = q.view(T, nH, N + R).transpose(0, 1).split([N, R], dim=-1)  # [nH, T, N], [nH, T, R]
    latent, k_rot = F.linear(x, w.kv_a, w.kv_a_bias).split([r, R], dim=-1)  # [T, r], [T, R]
    rotate = rope_interleaved if m.rope_interleave else apply_rope
    q_rot, k_rot = rotate(q_rot, cos, sin), rotate(k_rot[None], cos, sin)[0]
    cache[pos : pos + T, :r] = blocks.rms_norm(latent, w.kv_a_norm, LORA_NORM_EPS)
    cache[pos : pos + T, r:] = k_rot
    seen = cache[: pos + T]  # [S, r + R]
    kv_b = w.kv_b.view(nH, N + V, r)
    if absorbs(m, T) if absorb is None else absorb:  # kv_b moves into the query and the output
        q_lat = torch.matmul(q_nope, kv_b[:, :N])  # [nH, T, r]
        qc = torch.cat((q_lat, q_rot), dim=-1).view(nH * T, r + R)  # one key head for all: heads fold into rows
        scores = torch.matmul(qc, seen.T).view(nH, T, -1) * m.softmax_scale  # [nH, T, S]
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
        o_lat = torch.matmul(probs.view(nH * T, -1), seen[:, :r]).view(nH, T, r)  # [nH, T, r]
        out = torch.matmul(o_lat, kv_b[:, N:].transpose(1, 2))  # [nH, T, V]
    else:  # expand every seen position's heads
        S = seen.shape[0]
        kv = F.linear(seen[:, :r], w.kv_b).view(S, nH, N + V).transpose(0, 1)  # [nH, S, N+V]
        k = torch.cat((kv[..., :N], seen[None, :, r:].expand(nH, S, R)), dim=-1)  # [nH, S, N+R]
        qf = torch.cat((q_nope, q_rot), dim=-1)  # [nH, T, N+R]
        out = F.scaled_dot_product_attention(qf[None], k[None], kv[None, ..., N:], attn_mask=mask,
                                             scale=m.softmax_scale)[0]  # [nH, T, V]
    return F.linear(out.transpose(0, 1).reshape(T, nH * V), lw.o, lw.o_bias)
