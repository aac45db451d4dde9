"""Gated DeltaNet (Qwen3-Next, Qwen3.5 / 3.6: 3 of every 4 layers), a linear-attention mixer whose state does not
grow with the context (Spec.delta, DeltaNetWeights, LayerCache.conv / .recurrent):

    q | k | v, z, b, a = the input projections of x     (Qwen3.5: four; Qwen3-Next: two fused, grouped by key head)
    q | k | v = silu(causal depthwise conv over the last K inputs)   the conv carries its last K - 1 inputs
    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)       per value head and token (g in float32)
    o = the gated delta rule of q, k, v, g, beta                     layers/delta_rule.py, the state carried
    out_proj(rms_norm(o) * norm.weight * act(z))                     per value head; act: silu, or sigmoid
                                                                     (Qwen4-Exp's output_gate_type)

A prompt runs the chunked form of the rule, a decode token the recurrent one: where the model computes in float32 or
bf16, everything from the conv to the gated norm as one native call per layer (native/deltanet.py, chosen at build:
Kernels.native_deltanet; the torch steps otherwise). The state is zeroed when a pass starts at position 0 and must
otherwise continue where the last pass ended: it cannot be rewound (LayerCache.pos; the engine reuses a prompt's
prefix accordingly).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..linear import linear
from . import delta_rule
from .build import ACTIVATIONS, Build, Step
from .norm import gated_rms_norm


class GatedDeltaNet:
    """Layer L's Gated DeltaNet: x [T, H] -> [T, H], carrying the layer's conv and recurrent state."""

    def __init__(self, b: Build, L: int):
        s, lw = b.spec, b.w.layers[L]
        self.d, self.w, self.o, self.L = s.delta, lw.delta, lw.o, L
        self.cache = b.cache.layers[L]
        self.eps, self.bf16, self.act = s.rms_norm_eps, b.compute.bf16_gemm, b.act
        self.neg_A = -self.w.A_log.float().exp()  # [Hv] float32, the reference's -exp(A_log) once
        self.gate_act = ACTIVATIONS[self.d.gate_act]
        self.project = self._fused if self.w.qkvz is not None else self._separate
        self.prompt_rule, self.decode_rule = delta_rule.chunked, delta_rule.recurrent
        # a decode token from the conv to the gated norm, both states in place (Build.native_deltanet); the kernel's
        # output gate is silu: a sigmoid-gated layer (Qwen4-Exp) keeps the torch steps
        native = b.deltanet_decode is not None and self.d.gate_act == "silu"
        self.native = None if not native else b.deltanet_decode.layer(
            self.w.conv, self.cache.conv, self.cache.recurrent, self.neg_A, self.w.dt_bias, self.w.norm, self.eps)

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        d, c, T = self.d, self.cache, x.shape[0]
        if step.pos == 0:
            c.conv.zero_()
            c.recurrent.zero_()
        elif step.pos != c.pos:
            raise RuntimeError(f"layer {self.L}: its Gated DeltaNet state holds {c.pos} tokens and cannot continue "
                               f"at position {step.pos} (a recurrent state is not rewound; start at 0)")
        qkv, z, b, a = self.project(x)  # [T, conv_dim], [T, value_dim], [T, Hv], [T, Hv]
        if T == 1 and self.native is not None:
            o = self.native(qkv.contiguous(), z.contiguous(), b.contiguous(), a.contiguous())  # [1, value_dim]
        else:
            o = self._steps(qkv, z, b, a).reshape(T, d.value_dim)
        c.pos = step.pos + T
        return linear(o, self.o, None, self.bf16)

    def _steps(self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The torch steps from the projections to the gated norm: [T, Hv, Dv] in x's dtype."""
        d, T = self.d, qkv.shape[0]
        q, k, v = self._conv(qkv).split([d.key_dim, d.key_dim, d.value_dim], dim=-1)
        q, k = q.reshape(T, d.n_k_heads, d.k_head_dim), k.reshape(T, d.n_k_heads, d.k_head_dim)
        v = v.reshape(T, d.n_v_heads, d.v_head_dim)
        beta = b.sigmoid()
        g = self.neg_A * F.softplus(a.float() + self.w.dt_bias)  # [T, Hv] float32
        rule = self.decode_rule if T == 1 else self.prompt_rule
        o = rule(q, k, v, g, beta, self.cache.recurrent)  # [T, Hv, Dv] in x's dtype
        return gated_rms_norm(o, z.view(T, d.n_v_heads, d.v_head_dim), self.w.norm, self.eps, self.gate_act)

    def _conv(self, qkv: torch.Tensor) -> torch.Tensor:
        """The causal depthwise conv of qkv [T, C] after the layer's last K - 1 inputs, silu -> [T, C]; the last
        K - 1 inputs are kept for the next pass."""
        state, w = self.cache.conv, self.w.conv  # [C, K - 1], [C, 1, K]
        seq = torch.cat([state, qkv.transpose(0, 1)], dim=1)  # [C, K - 1 + T]
        state.copy_(seq[:, seq.shape[1] - state.shape[1] :])
        out = F.conv1d(seq[None].to(w.dtype), w, groups=w.shape[0])[0]  # [C, T]
        return self.act(out).to(qkv.dtype).transpose(0, 1)

    def _separate(self, x: torch.Tensor):
        """Qwen3.5's projections: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a."""
        w, bf16 = self.w, self.bf16
        return tuple(linear(x, p, None, bf16) for p in (w.qkv, w.z, w.b, w.a))

    def _fused(self, x: torch.Tensor):
        """Qwen3-Next's in_proj_qkvz / in_proj_ba, whose rows go key head by key head (per key head: q, k, then its
        r = Hv / nK value heads' v, then their z; its value heads' b, then their a), split into the order of
        Qwen3.5's four."""
        d, T = self.d, x.shape[0]
        r, Dk = d.n_v_heads // d.n_k_heads, d.k_head_dim
        qkvz = linear(x, self.w.qkvz, None, self.bf16).view(T, d.n_k_heads, 2 * Dk + 2 * r * d.v_head_dim)
        q, k, v, z = qkvz.split([Dk, Dk, r * d.v_head_dim, r * d.v_head_dim], dim=-1)
        qkv = torch.cat([q.reshape(T, d.key_dim), k.reshape(T, d.key_dim), v.reshape(T, d.value_dim)], dim=-1)
        b, a = linear(x, self.w.ba, None, self.bf16).view(T, d.n_k_heads, 2 * r).split([r, r], dim=-1)
        return qkv, z.reshape(T, d.value_dim), b.reshape(T, d.n_v_heads), a.reshape(T, d.n_v_heads)
