"""Attention sinks (gpt-oss): one learned logit per head joins each query's softmax."""

from __future__ import annotations

import torch

#: bytes of one [nH, rows, P] score block of sink_attention: query rows run in blocks this size bounds (gpt-oss-20b,
#: 64 heads, 4k positions, float32: 64 rows; at 128k positions, 2 rows); decode is one row
SINK_SCORE_BYTES = 64 * 2**20


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   sinks: torch.Tensor) -> torch.Tensor:
    """Causal attention whose softmax also counts one learned logit per head (gpt-oss's attention sinks).

    q [nH, T, D], k/v [nKV, P, D] (the cache up to the last query), mask [T, P] bool (True = attend) or None (all),
    sinks [nH] -> [nH, T, D]. SDPA has no sink term, so this computes what the reference's eager attention does, op
    for op: scores scaled by 1/sqrt(D), masked, the sink appended as one more column, the row max subtracted,
    softmax, the sink's column dropped, then @ v. (The same result is SDPA's output times sigmoid(lse - sink), but
    CPU SDPA does not return its log-sum-exp.) Query rows run in blocks whose scores fit SINK_SCORE_BYTES.
    """
    nH, T, D = q.shape
    group = nH // k.shape[0]
    k = k.repeat_interleave(group, dim=0)  # [nH, P, D]
    v = v.repeat_interleave(group, dim=0)
    sink = sinks.to(q.dtype).view(nH, 1, 1)
    rows = max(1, SINK_SCORE_BYTES // (nH * k.shape[1] * 4))
    out = []
    for t0 in range(0, T, rows):
        qb = q[:, t0 : t0 + rows]  # [nH, t, D]
        scores = torch.matmul(qb, k.transpose(1, 2)) * D**-0.5  # [nH, t, P]
        if mask is not None:
            scores = scores.masked_fill(~mask[t0 : t0 + rows], float("-inf"))
        logits = torch.cat([scores, sink.expand(nH, scores.shape[1], 1)], dim=-1)  # [nH, t, P + 1]
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        out.append(torch.matmul(probs.to(v.dtype), v))  # [nH, t, D]
    return torch.cat(out, dim=1)
