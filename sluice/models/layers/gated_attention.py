"""Gated full attention (Qwen3-Next, Qwen3.5 / 3.6: every 4th layer; Spec.attn_gate): q_proj gives each head its
queries and as many gate values, and the attended heads are scaled by sigmoid(gate) before o_proj. Everything
between (per-head zero-centred q / k norms, partial rope, the KV cache, the cores) is Attention's own (attention.py);
the one-call decode core applies the gate itself (native/decode.py)."""

from __future__ import annotations

import torch

from .attention import Attention
from .build import Step


class GatedAttention(Attention):
    """Layer L's gated attention: x [T, H] -> [T, H]. q_proj's rows go head by head: D query rows, then D gate
    rows."""

    GATED = True

    def __call__(self, x: torch.Tensor, step: Step, selected: torch.Tensor | None = None) -> torch.Tensor:
        """`selected`: the keys each query may see, when not all causal ones (Attention.attend; QSA, qsa.py)."""
        T, nH, D = x.shape[0], self.nH, self.D
        if T == 1 and self.fused is not None and selected is None:
            return self.decode_fused(x, step)
        qg, k, v = self.qkv(x)  # [T, 2*nH*D], [T, nKV*D], [T, nKV*D]
        q, gate = qg.view(T, nH, 2 * D).split(D, dim=-1)  # [T, nH, D] each
        # gated [T, nH*D]: sigmoid(gate) times the heads, in the decode core or after the prompt's
        return self.out(self.attend(q.reshape(T, nH * D), k, v, step, gate.reshape(T, nH * D), selected))
