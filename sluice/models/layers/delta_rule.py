"""The gated delta rule, Gated DeltaNet's linear attention, in its two exact forms (one module, used by every layer
that has it; models/layers/gated_deltanet.py runs it).

Per value head, a state S [Dk, Dv] (float32) carries everything the layer has seen. One token t, with its queries and
keys l2-normalised (the query also scaled by Dk^-0.5), decay g_t <= 0 (log space) and write strength beta_t in (0, 1):

    S <- exp(g_t) S                       forget
    u  = beta_t (v_t - S^T k_t)           the part of v_t the state does not predict yet (the delta rule)
    S <- S + k_t u^T                      write it
    o_t = S^T q_t                         read

`recurrent` runs that token by token (decode: one token, the state updated in place). `chunked` gives the same
outputs for a prompt in blocks of CHUNK tokens: inside a block the writes of earlier tokens are folded in by one
unit-lower-triangular solve (the UT transform of the DeltaNet paper), so a block is a handful of [C, C] and [C, D]
matrix products instead of C rank-one updates, and only the block boundaries are sequential. It follows the order of
operations of transformers' torch_chunk_gated_delta_rule (the reference both forms are tested against, in float32
and float64), so a prompt's outputs are those of the reference to float32 rounding.

Shapes (no batch): q, k [T, nK, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; state [Hv, Dk, Dv] float32, read and written in
place; the math runs in the state's dtype (float32; float64 in tests). When there are fewer key heads than value heads
(nK < Hv), key head i serves value heads i*r .. i*r + r-1 (r = Hv / nK). Outputs [T, Hv, Dv] in q's dtype.
"""

from __future__ import annotations

import torch

from ..spec import DELTA_CHUNK as CHUNK  # tokens per block of the chunked form (the reference's)
L2_EPS = 1e-6  # inside the square root of the l2 norm (FLA's kernels and the reference)


def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] / sqrt(sum x^2 + L2_EPS) along the last dim."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def _heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 dtype: torch.dtype):
    """The inputs in `dtype` with heads first: q, k repeated to the value heads and l2-normalised, [Hv, T, D]; v
    [Hv, T, Dv]; g, beta [Hv, T]."""
    r = v.shape[1] // k.shape[1]
    if r > 1:
        q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
    q, k, v = (t.transpose(0, 1).to(dtype).contiguous() for t in (q, k, v))
    g, beta = (t.transpose(0, 1).to(dtype).contiguous() for t in (g, beta))
    return l2_normalise(q), l2_normalise(k), v, g, beta


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> torch.Tensor:
    """The delta rule token by token (the decode step; see the module doc for shapes); `state` updated in place.
    Per token and head: a [1, Dk] x [Dk, Dv] product for what the state predicts, a rank-one write and a read, on
    the state where it lies (no copy of the 2 MiB state of a 32-head layer per step)."""
    dtype, T = q.dtype, q.shape[0]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, state.dtype)
    q = q / q.shape[-1] ** 0.5
    out = torch.empty_like(v)  # [Hv, T, Dv]
    decay = g.exp()  # [Hv, T]
    for t in range(T):
        kt, qt = k[:, t : t + 1], q[:, t : t + 1]  # [Hv, 1, Dk]
        state.mul_(decay[:, t, None, None])
        u = (v[:, t : t + 1] - torch.bmm(kt, state)) * beta[:, t, None, None]  # [Hv, 1, Dv]
        state.baddbmm_(kt.transpose(1, 2), u)  # S + k u^T
        torch.bmm(qt, state, out=out[:, t : t + 1])
    return out.transpose(0, 1).to(dtype)


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The delta rule over a prompt in blocks of `chunk` tokens (see the module doc for shapes); `state` updated in
    place. T is padded to whole blocks with zeros (a padded token writes nothing: beta 0, and decays nothing: g 0)."""
    dtype, T = q.dtype, q.shape[0]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, state.dtype)
    q = q * q.shape[-1] ** -0.5
    pad = -T % chunk
    if pad:
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (torch.nn.functional.pad(t, (0, pad)) for t in (g, beta))
    H, n = v.shape[0], (T + pad) // chunk
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (t.view(H, n, chunk, t.shape[-1]) for t in (q, k, k_beta, v_beta))  # [H, n, C, D]
    cum = g.view(H, n, chunk).cumsum(dim=-1)  # [H, n, C]: log of the decay from the block's start to each token
    # decay from token j to token i of a block, i >= j; 0 above the diagonal (exp(-inf))
    later = torch.ones(chunk, chunk, dtype=torch.bool).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(later, float("-inf")).exp()  # [H, n, C, C]
    # the in-block writes: unit lower triangular L with L[i, j] = beta_i (k_i . k_j) decay(j -> i), j < i
    tri = (k_beta @ k.transpose(-1, -2)) * decay
    scores = (q @ k.transpose(-1, -2)) * decay  # [H, n, C, C] q_i . k_j decay(j -> i), j <= i
    # (I + L)^-1 by one solve against the identity, applied to both right-hand sides by products, as the reference
    # applies the inverse it builds row by row: u = (I + L)^-1 (v_beta - k_beta exp(cum) S0), the values each token
    # writes, before the block's start state S0. One solve of C columns instead of two of Dv and Dk, and blocks-first
    # operands for the loop: 448 vs 598 ms a layer on a 2,048-token prompt at Qwen3.5's shapes, float32 outputs
    # equally far (1.5e-6) from a float64 run (benchmarks/results/hybrid/delta_rule_timing.py, its .txt).
    eye = torch.eye(chunk, dtype=tri.dtype).expand_as(tri)
    inv = torch.linalg.solve_triangular(tri, eye, upper=False, unitriangular=True)  # [H, n, C, C]
    # blocks first, each operand of the loop one contiguous [H, ., .] matrix per block
    new_values = (inv @ v_beta).transpose(0, 1).contiguous()  # [n, H, C, Dv]
    k_decayed = (inv @ (k_beta * cum.exp()[..., None])).transpose(0, 1).contiguous()  # [n, H, C, Dk]
    q = (q * cum.exp()[..., None]).transpose(0, 1).contiguous()  # [n, H, C, Dk]: reads S0 decayed to each token
    k = (k * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2)  # writes decayed to the block's end
    k = k.transpose(0, 1).contiguous()  # [n, H, Dk, C]
    scores = scores.transpose(0, 1).contiguous()  # [n, H, C, C]
    block_decay = cum[..., -1].exp().transpose(0, 1)[..., None, None]  # [n, H, 1, 1]
    out = torch.empty_like(new_values)  # [n, H, C, Dv]
    for i in range(n):
        u = torch.baddbmm(new_values[i], k_decayed[i], state, alpha=-1)  # [H, C, Dv]
        torch.bmm(q[i], state, out=out[i]).baddbmm_(scores[i], u)
        state.mul_(block_decay[i]).baddbmm_(k[i], u)
    return out.transpose(1, 2).reshape(n * chunk, H, -1)[:T].to(dtype)  # [T, H, Dv]
