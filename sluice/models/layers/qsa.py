"""QSA indexed attention (qwen4_exp's full-attention layers; Spec.qsa): gated attention (gated_attention.py) whose
queries see only the keys an indexer picks for them.

    q_i, k = index_qk_proj(x): n_heads query heads and one key head of Di     the key kept raw in the cache
             (a GGUF: indexer.q_proj(x), indexer.k_proj(x), llama.cpp's converter's split of it)
    q_i    = rope(q_layernorm(q_i)) at the query's position
    block j (positions j*c .. j*c+c-1, c = compress_ratio, complete ones only):
        key_j  = rope(k_layernorm(mean of its raw keys)) at position j*c
    score  = sum over the query heads of relu(q_i . key_j) / sqrt(Di)
    the query at p sees: the best budget/c of its complete blocks (all when it has no more), plus the tail
    (p // c * c .. p, the tokens past its last complete block)

A query with at most budget/c complete blocks sees every earlier token: the mask is the causal one and Attention's
usual cores run. Past that the selection is a boolean mask [T, pos+T] for SDPA (attention.py `selected`).
The blocks' keys are recomputed from the raw keys each pass (decode keeps only the raw keys, as the reference does);
queries are grouped by how many complete blocks they see, and each group's top blocks are one topk call over exactly
the blocks its queries see (the reference calls topk query by query over the same scores).
"""

from __future__ import annotations

import math

import torch

from ..linear import linear
from ..rope import apply_rope
from .build import Build, Step
from .gated_attention import GatedAttention


class IndexedAttention(GatedAttention):
    """Layer L's QSA attention: x [T, H] -> [T, H], writing its keys, values and raw indexer keys in place."""

    def __init__(self, b: Build, L: int):
        super().__init__(b, L)
        self.qsa, w = b.spec.qsa, self.lw.indexer
        self.indexer = w
        self.index_q_norm, self.index_k_norm = b.norm(w.q_norm), b.norm(w.k_norm)
        self.keys = b.cache.layers[L].index_keys  # [P, Di] raw keys

    def __call__(self, x: torch.Tensor, step: Step, selected: torch.Tensor | None = None) -> torch.Tensor:
        return super().__call__(x, step, self.select(x, step))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's queries [T, nI*Di] and raw key [T, Di] of x [T, H]."""
        w = self.indexer
        if w.qk is None:  # stored as two (QSASpec.split)
            return linear(x, w.q, None, self.bf16), linear(x, w.k, None, self.bf16)
        return linear(x, w.qk, None, self.bf16).split([self.qsa.n_heads * self.qsa.head_dim, self.qsa.head_dim],
                                                      dim=-1)

    def select(self, x: torch.Tensor, step: Step) -> torch.Tensor | None:
        """The keys each of this pass's queries sees: a bool mask [T, pos+T], or None when that is every earlier
        one (no query has more than budget / c complete blocks). Writes the pass's raw indexer keys."""
        a, T, pos = self.qsa, x.shape[0], step.pos
        c, Di, nI = a.compress_ratio, a.head_dim, a.n_heads
        q, k = self.project(x)  # [T, nI*Di], [T, Di]
        self.keys[pos : pos + T] = k
        n_blocks = (pos + T) // c  # complete blocks the last query sees
        if n_blocks <= a.block_topk:
            return None
        q = self.index_q_norm(q.view(T, nI, Di)).transpose(0, 1)  # [nI, T, Di]
        q = apply_rope(q, self.cos[pos : pos + T], self.sin[pos : pos + T], self.path)
        raw = self.keys[: n_blocks * c].view(n_blocks, c, Di)
        pooled = self.index_k_norm(raw.float().mean(dim=1).to(raw.dtype))  # [N, Di]
        starts = torch.arange(n_blocks) * c
        blocks = apply_rope(pooled[None], self.cos[starts], self.sin[starts], self.path)[0]  # [N, Di]
        scores = torch.relu(q.float() @ blocks.float().T).sum(dim=0) / math.sqrt(Di)  # [T, N]
        return _mask(scores, pos, c, a.block_topk)


def _mask(scores: torch.Tensor, pos: int, c: int, topk: int) -> torch.Tensor:
    """scores [T, N] of every complete block up to the last query -> the bool mask [T, pos+T]: each query's top
    `topk` of the complete blocks it sees (all of them when no more), its tail, nothing after it."""
    T, N = scores.shape
    seen = (pos + 1 + torch.arange(T)) // c  # [T] complete blocks each query sees
    chosen = torch.zeros(T, N, dtype=torch.bool)
    for n in torch.unique_consecutive(seen).tolist():
        rows = (seen == n).nonzero().flatten()
        if n <= topk:
            chosen[rows, :n] = True
        else:
            best = scores[rows, :n].topk(topk, dim=-1).indices  # [rows, topk]
            chosen[rows[:, None], best] = True
    t = torch.arange(pos + T)  # key positions
    in_chosen = chosen[:, (t // c).clamp(max=N - 1)] & (t < N * c)  # [T, pos+T]
    tail = t[None, :] >= (seen * c)[:, None]
    causal = t[None, :] <= (pos + torch.arange(T))[:, None]
    return (in_chosen | tail) & causal
