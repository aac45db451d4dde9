"""Grouped-query attention, the mixer of every architecture here but DeepSeek's: q / k / v / o projections (biases
optional), q / k RMSNorm per head or over the whole projection, clipping, rope, the KV cache, and a core that
attends. The cores are chosen when the layer is built:

  - a bf16 decode token of a model whose projections and experts all run natively: the norms, rope, cache writes
    and attention in one native call (native/decode.py; within bf16 rounding of SDPA, not bitwise);
  - attention sinks (gpt-oss, sinks.py): the reference's eager attention with the sink column;
  - a prompt where Compute allows it: attend.c's causal attention (bf16 products, about half SDPA's time);
  - a prompt's first pass: SDPA with is_causal (it skips the blocks above the diagonal: 2,048 tokens, 8 heads of
    128, bf16: 52 vs 90 ms per layer, the same bits; benchmarks/prefill/knobs.py sdpa), on bf16 dot products with
    float32 sums where the model multiplies on bf16 GEMMs (quant/matmul.py sdpa);
  - later chunks of a prompt and torch decode steps: SDPA with the mask.
"""

from __future__ import annotations

import torch

from ...quant.linear import Q8_MAX_ROWS, QuantLinear
from ...quant.matmul import sdpa
from ...quant.native import attend
from ..linear import linear
from ..rope import apply_rope
from .build import Build, Step
from .norm import rms_norm
from .sinks import sink_attention


class Attention:
    """The GQA attention of layer L: x [T, H] -> [T, H], writing the layer's KV cache in place."""

    def __init__(self, b: Build, L: int):
        s, lw, c = b.spec, b.w.layers[L], b.compute
        self.lw, self.L = lw, L
        self.nH, self.nKV, self.D = s.n_heads, s.n_kv_heads, s.head_dim
        self.eps, self.qk_norm, self.clip = s.rms_norm_eps, s.qk_norm, s.clip_qkv
        self.window = s.sliding_window[L]
        self.bf16, self.path = c.bf16_gemm, c.path
        self.cos, self.sin = b.cos, b.sin
        self.ck, self.cv = b.cache.k[L], b.cache.v[L]  # [nKV, P, D]
        ws = (lw.q, lw.k, lw.v)
        self.biases = (lw.q_bias, lw.k_bias, lw.v_bias)
        # kept-quantized q / k / v at decode: one native call, x quantized once, their rows over the native threads,
        # bitwise what three QuantLinear calls give
        self.qkv_group = QuantLinear.group(list(ws)) if all(type(w) is QuantLinear for w in ws) else None
        self.decode = None if b.decode_attention is None else b.decode_attention.layer(
            self.ck, self.cv, norm=s.qk_norm, q_norm=lw.q_norm, k_norm=lw.k_norm, eps=s.rms_norm_eps,
            clip=s.clip_qkv, sinks=None if lw.sinks is None else lw.sinks.to(c.dtype).float().contiguous())
        # attend.c: causal, bf16 products; not with sinks (their column), nor keys a sliding window cuts (per call)
        self.prompt_native = (b.kernels.native_prompt_attention and c.attend_prompt and lw.sinks is None
                              and attend.supports(s.n_heads, s.n_kv_heads, s.head_dim))

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of x [T, H]: [T, nH*D], [T, nKV*D], [T, nKV*D]."""
        lw = self.lw
        if self.qkv_group is None or x.shape[0] > Q8_MAX_ROWS:
            return tuple(linear(x, w, b, self.bf16) for w, b in zip((lw.q, lw.k, lw.v), self.biases))
        return tuple(self.qkv_group.linear(x, self.biases))

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        lw, T, pos, D = self.lw, x.shape[0], step.pos, self.D
        win = self.window
        q, k, v = self.qkv(x)
        if T == 1 and self.decode is not None:
            out = self.decode(q, k, v, pos, max(0, pos - win + 1) if win is not None else 0)  # [1, nH*D]
            return linear(out, lw.o, lw.o_bias, self.bf16)
        if self.qk_norm == "full":
            q, k = rms_norm(q, lw.q_norm, self.eps, self.path), rms_norm(k, lw.k_norm, self.eps, self.path)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = q.view(T, self.nH, D)
        k = k.view(T, self.nKV, D)
        if self.qk_norm == "head":
            q, k = rms_norm(q, lw.q_norm, self.eps, self.path), rms_norm(k, lw.k_norm, self.eps, self.path)
        cos, sin = self.cos[pos : pos + T], self.sin[pos : pos + T]  # [T, rot]
        q = apply_rope(q.transpose(0, 1), cos, sin, self.path)  # [nH, T, D]
        k = apply_rope(k.transpose(0, 1), cos, sin, self.path)  # [nKV, T, D]
        ck, cv = self.ck, self.cv
        ck[:, pos : pos + T] = k
        cv[:, pos : pos + T] = v.view(T, self.nKV, D).transpose(0, 1)
        mask = step.mask(win)
        if lw.sinks is not None:
            # a sliding layer's queries see nothing before pos - window + 1: those keys are not scored at all
            lo = max(0, pos - win + 1) if win is not None else 0
            part = None if mask is None else mask[:, lo:]
            out = sink_attention(q, ck[:, lo : pos + T], cv[:, lo : pos + T], part, lw.sinks)  # [nH, T, D]
        elif T > 1 and self.prompt_native and (win is None or pos + T <= win):
            return linear(attend.causal(q, ck, cv, pos), lw.o, lw.o_bias, self.bf16)
        elif pos == 0 and mask is not None and (win is None or T <= win):
            # a prompt's first pass: the mask is the lower triangle, which SDPA's is_causal draws itself
            out = sdpa(q[None], ck[None, :, :T], cv[None, :, :T], self.bf16, is_causal=True,
                       enable_gqa=True)[0]  # [nH, T, D]
        else:  # later chunks of a prompt, decode on the torch path
            out = sdpa(q[None], ck[None, :, : pos + T], cv[None, :, : pos + T], self.bf16, attn_mask=mask,
                       enable_gqa=True)[0]  # [nH, T, D]
        out = out.transpose(0, 1).reshape(T, self.nH * D)
        return linear(out, lw.o, lw.o_bias, self.bf16)
