"""Grouped-query attention, the mixer of every architecture here but DeepSeek's: q / k / v / o projections (biases
optional), q / k RMSNorm per head or over the whole projection, clipping, rope, the KV cache, and a core that
attends. The cores are chosen when the layer is built:

  - a bf16 decode token of a model whose projections and experts all run natively: the norms, rope, cache writes
    and attention in one native call (native/decode.py; within bf16 rounding of SDPA, not bitwise), and with the
    q / k / v and o projections around it in the same call where they are kept quantized (AttentionFused, bitwise
    the separate calls);
  - attention sinks (gpt-oss, sinks.py): the reference's eager attention with the sink column;
  - a prompt where Compute allows it: attend.c's causal attention (bf16 products, about half SDPA's time);
  - a prompt's first pass: SDPA with is_causal (it skips the blocks above the diagonal: 2,048 tokens, 8 heads of
    128, bf16: 52 vs 90 ms per layer, the same bits; benchmarks/prefill/knobs.py sdpa), on bf16 dot products with
    float32 sums where the model multiplies on bf16 GEMMs (quant/matmul.py sdpa), on its bf16 inputs where the CPU
    has AMX and the pass is long (Compute.sdpa_widen);
  - later chunks of a prompt and torch decode steps: SDPA with the mask.

`attend` (q / k / v -> the attended heads, before the output projection) and `out` are the pieces another
attention reuses where its math is the same (gated_attention.py: the gate between them).
"""

from __future__ import annotations

import torch

from ...quant.linear import Q8_MAX_ROWS, QuantLinear
from ...quant.matmul import sdpa
from ...quant.native import attend
from ...quant.native.decode import AttentionFused
from ..linear import linear
from ..rope import apply_rope
from .build import Build, Step
from .sinks import sink_attention


class Attention:
    """The GQA attention of layer L: x [T, H] -> [T, H], writing the layer's KV cache in place."""

    GATED = False  # q_proj gives each head its queries and as many gate values (gated_attention.py)

    def __init__(self, b: Build, L: int):
        s, lw, c = b.spec, b.w.layers[L], b.compute
        self.lw, self.L = lw, L
        self.nH, self.nKV, self.D = s.n_heads, s.n_kv_heads, s.head_dim
        self.qk_norm, self.clip = s.qk_norm, s.clip_qkv
        self.q_norm = None if lw.q_norm is None else b.norm(lw.q_norm)
        self.k_norm = None if lw.k_norm is None else b.norm(lw.k_norm)
        self.window = s.sliding_window[L]
        self.bf16, self.path = c.bf16_gemm, c.path
        self.sdpa_widen = c.sdpa_widen  # rows -> a prompt's SDPA in float32 on bf16 products, or on bf16 (AMX)
        self.cos, self.sin = b.cos, b.sin
        self.ck, self.cv = b.cache.layers[L].k, b.cache.layers[L].v  # [nKV, P, D]
        ws = (lw.q, lw.k, lw.v)
        self.biases = (lw.q_bias, lw.k_bias, lw.v_bias)
        # kept-quantized q / k / v at decode: one native call, x quantized once, their rows over the native threads,
        # bitwise what three QuantLinear calls give
        self.qkv_group = QuantLinear.group(list(ws)) if all(type(w) is QuantLinear for w in ws) else None
        self.decode = None if b.decode_attention is None else b.decode_attention.layer(
            self.ck, self.cv, norm=s.qk_norm, q_norm=lw.q_norm, k_norm=lw.k_norm, eps=s.rms_norm_eps,
            clip=s.clip_qkv, sinks=None if lw.sinks is None else lw.sinks.to(c.dtype).float().contiguous(),
            zero_centred=s.zero_centred_norms)
        # a decode token's projections, core and o_proj in one native call where q / k / v are grouped without
        # biases and o_proj is a kept-quantized weight of its own group: the same C calls on the same values, without
        # the Python between them (native/decode.py AttentionFused)
        o_group = getattr(lw.o, "_group", None) if type(lw.o) is QuantLinear else None
        self.fused = None
        if (self.decode is not None and self.qkv_group is not None and o_group is not None and lw.o_bias is None
                and all(x is None for x in self.biases) and b.dtype is torch.bfloat16):
            self.fused = AttentionFused(self.decode, self.qkv_group._q8, o_group._q8, self.GATED, c.planes, c.path)
        # attend.c: causal, bf16 products (attend_avx2.c: float32, where GEMMs are float32); not with sinks (their
        # column), nor keys a sliding window cuts (per call)
        self.prompt_f32 = c.attend_prompt_f32
        self.prompt_native = (b.kernels.native_prompt_attention and (c.attend_prompt or self.prompt_f32)
                              and lw.sinks is None and attend.supports(s.n_heads, s.n_kv_heads, s.head_dim))

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of x [T, H]: [T, nH*D], [T, nKV*D], [T, nKV*D]."""
        lw = self.lw
        if self.qkv_group is not None and x.shape[0] <= Q8_MAX_ROWS:
            return tuple(self.qkv_group.linear(x, self.biases))
        ys = None if self.qkv_group is None else self.qkv_group.prompt_rows(x, self.biases)  # x coded once
        if ys is not None:
            return tuple(ys)
        return tuple(linear(x, w, b, self.bf16) for w, b in zip((lw.q, lw.k, lw.v), self.biases))

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        if x.shape[0] == 1 and self.fused is not None:
            return self.decode_fused(x, step)
        q, k, v = self.qkv(x)
        return self.out(self.attend(q, k, v, step))

    def decode_fused(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """A decode token x [1, H] through `fused` (what qkv, attend and out give it, bitwise)."""
        win, pos = self.window, step.pos
        return self.fused(x.contiguous(), pos, max(0, pos - win + 1) if win is not None else 0)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """The output projection: o [T, nH*D] -> [T, H]."""
        return linear(o, self.lw.o, self.lw.o_bias, self.bf16)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step,
               gate: torch.Tensor | None = None, selected: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, nH*D], k / v [T, nKV*D] of this pass's tokens -> the attended heads [T, nH*D]: the q / k norms,
        clipping, rope, the cache writes, then the core chosen at build; gate [T, nH*D] (gated attention): the heads
        times sigmoid(gate). `selected`: a boolean mask [T, pos+T] that replaces the causal one (QSA's choice of
        keys, qsa.py; causal itself): SDPA with it, whatever the pass."""
        if q.shape[0] == 1 and self.decode is not None and selected is None:
            win, pos = self.window, step.pos
            return self.decode(q, k, v, pos, max(0, pos - win + 1) if win is not None else 0, gate)  # [1, nH*D]
        out = self._attend(q, k, v, step, selected)
        return out if gate is None else out * torch.sigmoid(gate)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step,
                selected: torch.Tensor | None = None) -> torch.Tensor:
        """attend's torch steps and prompt cores."""
        lw, T, pos, D = self.lw, q.shape[0], step.pos, self.D
        win = self.window
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = q.view(T, self.nH, D)
        k = k.view(T, self.nKV, D)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.cos[pos : pos + T], self.sin[pos : pos + T]  # [T, rot]
        q = apply_rope(q.transpose(0, 1), cos, sin, self.path)  # [nH, T, D]
        k = apply_rope(k.transpose(0, 1), cos, sin, self.path)  # [nKV, T, D]
        ck, cv = self.ck, self.cv
        ck[:, pos : pos + T] = k
        cv[:, pos : pos + T] = v.view(T, self.nKV, D).transpose(0, 1)
        mask = step.mask(win)
        if selected is not None:
            out = sdpa(q[None], ck[None, :, : pos + T], cv[None, :, : pos + T], self.sdpa_widen(T),
                       attn_mask=selected, enable_gqa=True)[0]  # [nH, T, D]
        elif lw.sinks is not None:
            # a sliding layer's queries see nothing before pos - window + 1: those keys are not scored at all
            lo = max(0, pos - win + 1) if win is not None else 0
            part = None if mask is None else mask[:, lo:]
            out = sink_attention(q, ck[:, lo : pos + T], cv[:, lo : pos + T], part, lw.sinks)  # [nH, T, D]
        elif T > 1 and self.prompt_native and (win is None or pos + T <= win):
            return attend.causal(q, ck, cv, pos, self.prompt_f32, self.path)  # [T, nH*D]
        elif pos == 0 and mask is not None and (win is None or T <= win):
            # a prompt's first pass: the mask is the lower triangle, which SDPA's is_causal draws itself
            out = sdpa(q[None], ck[None, :, :T], cv[None, :, :T], self.sdpa_widen(T), is_causal=True,
                       enable_gqa=True)[0]  # [nH, T, D]
        else:  # later chunks of a prompt, decode on the torch path
            out = sdpa(q[None], ck[None, :, : pos + T], cv[None, :, : pos + T], self.sdpa_widen(T),
                       attn_mask=mask, enable_gqa=True)[0]  # [nH, T, D]
        return out.transpose(0, 1).reshape(T, self.nH * D)
