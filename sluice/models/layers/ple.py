"""PLE, per-layer embeddings of hashed n-grams (qwen4_exp; Spec.ple, PLESpec): before its mixer a PLE layer looks up,
for every token, one row per n-gram head in its own large table, and adds a gated mix of them to every residual
stream (hyper.py's streams, n of H).

    n-gram ids  order k (2..ngram_size) of the token at p: (t_p m0 ^ t_(p-1) m1 ^ ... ^ t_(p-k+1) m(k-1)) mod vocab_h
                + offset_h for each of the order's heads h (models/ngram.py: primes, multipliers); an earlier token
                counts as end-of-sequence when an end-of-sequence token lies between it and p (it included): n-grams
                restart after one; before the first token there are only end-of-sequence tokens
    e           = the rows of all heads side by side                  [T, E]   the table, read by rows (RowTable)
    key         = norm_key(key_proj(e))   per stream                  [T, n, H]
    value       = value_proj(e)                                       [T, H]
    gate        = (key . norm_query(x)) / sqrt(H) per stream, then sign(g) sqrt(max(|g|, 1e-6))
    v           = sigmoid(gate) value                                 [T, n, H]
    out         = v + silu(conv(norm_conv(v)))                        the conv: depthwise, K taps, dilation ngram_size

The table is the only large tensor: each pass gathers the rows of all its tokens and heads in one RowTable call
(distinct rows read once, in file order). The block keeps the pass's last ngram_size - 1 token ids and the conv's
last (K - 1) * ngram_size inputs for the next pass (LayerCache.ple_ids / ple_conv): a pass starts at 0 (an empty
history) or where the last ended, as the layer's Gated DeltaNet does (it sets LayerCache.pos).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..linear import linear
from .build import Build, Step


class PLE:
    """Layer L's PLE block: the streams x [T, n*H] -> what it adds to them [T, n*H]."""

    def __init__(self, b: Build, L: int):
        s, p, w = b.spec, b.spec.ple, b.w.layers[L].ple
        i = p.index(L)
        self.L, self.p, self.w, self.n, self.H = L, p, w, s.hc_count, s.hidden_size
        self.table = b.tables[L]  # gather(ids [T, heads]) -> [T, heads, head_dim] in the compute dtype
        self.cache, self.bf16 = b.cache.layers[L], b.compute.bf16_gemm
        self.sizes = torch.tensor(p.head_sizes[i], dtype=torch.int64)  # [heads]
        self.offsets = torch.tensor(p.offsets[i], dtype=torch.int64)
        self.mult = p.multipliers[i]  # python ints: < 2^63 / vocab, so t * m stays in int64
        self.norm_key, self.norm_query, self.norm_conv = (b.norm(t, group=self.H)
                                                          for t in (w.norm_key, w.norm_query, w.norm_conv))

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        T, n, H, w = x.shape[0], self.n, self.H, self.w
        e = self.table.gather(self.row_ids(step)).reshape(T, self.p.embed_dim)  # [T, E]
        key = self.norm_key(linear(e, w.key, None, self.bf16)).view(T, n, H)
        value = linear(e, w.value, None, self.bf16)  # [T, H]
        query = self.norm_query(x).view(T, n, H)
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(H)  # [T, n, 1]
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        v = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)  # [T, n*H]
        return v + self._conv(self.norm_conv(v))

    def row_ids(self, step: Step) -> torch.Tensor:
        """This pass's rows of the table [T, heads] (int64), from its tokens and the ids kept from the last pass;
        keeps the last ngram_size - 1 ids for the next."""
        p, c = self.p, self.cache
        if step.pos == 0:
            c.ple_ids.fill_(p.eos_token_id)
            c.ple_conv.zero_()
        elif step.pos != c.pos:
            raise RuntimeError(f"layer {self.L}: its PLE block holds the history of {c.pos} tokens and cannot "
                               f"continue at position {step.pos} (start at 0)")
        hist = torch.cat([c.ple_ids, step.tokens.to(torch.int64)])  # [ctx + T]
        c.ple_ids.copy_(hist[hist.shape[0] - p.context :])
        return ngram_rows(hist, p.context, p.eos_token_id, self.mult, self.sizes, self.offsets, p.heads_per_ngram)

    def _conv(self, v: torch.Tensor) -> torch.Tensor:
        """silu of the dilated depthwise conv of v [T, C] after the kept inputs -> [T, C]; keeps the last ones."""
        state, w = self.cache.ple_conv, self.w.conv  # [C, S], [C, 1, K]
        seq = torch.cat([state, v.transpose(0, 1)], dim=1)  # [C, S + T]
        state.copy_(seq[:, seq.shape[1] - state.shape[1] :])
        out = F.conv1d(seq[None].to(w.dtype), w, groups=w.shape[0], dilation=self.p.ngram_size)[0]  # [C, T]
        return F.silu(out).to(v.dtype).transpose(0, 1)


def ngram_rows(hist: torch.Tensor, context: int, eos: int, mult: list[int], sizes: torch.Tensor,
               offsets: torch.Tensor, per_order: int) -> torch.Tensor:
    """Row ids [T, heads] of the tokens hist[context:] (hist [context + T] int64: the `context` ids before them,
    then theirs). Orders 2..context+1, `per_order` heads each, in that order."""
    ctx, n = context, hist.shape[0]
    at = torch.arange(n)
    # the last end-of-sequence position before each position (-1: none)
    last_eos = torch.cummax(torch.where(hist == eos, at, -1), dim=0).values
    before = torch.cat([last_eos.new_full((1,), -1), last_eos[:-1]])[ctx:]  # [T]
    p = at[ctx:]  # [T] positions of this pass's tokens in hist
    mixed = hist[ctx:] * mult[0]  # [T]
    blocks = []
    for s in range(1, ctx + 1):  # the token s back, or eos where the n-gram would reach across one
        prev = torch.where(before < p - s, hist[p - s], eos)
        mixed = torch.bitwise_xor(mixed, prev * mult[s])  # the hash of the order-(s+1) n-gram
        h = slice((s - 1) * per_order, s * per_order)
        blocks.append(torch.remainder(mixed[:, None], sizes[h]) + offsets[h])  # [T, per_order]
    return torch.cat(blocks, dim=1)
