"""Gated DeltaNet (Qwen3-Next, Qwen3.5 / 3.6: 3 of every 4 layers), a linear-attention mixer whose state does not
grow with the context (Spec.delta, DeltaNetWeights, LayerCache.conv / .recurrent):

    q | k | v, z, b, a = the input projections of x     (Qwen3.5: four; Qwen3-Next: two fused, grouped by key head;
                                                        llama.cpp's qwen3next: q | k | v and z apart, b | a fused)
    q | k | v = silu(causal depthwise conv over the last K inputs)   the conv carries its last K - 1 inputs
    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)       per value head and token (g in float32)
    o = the gated delta rule of q, k, v, g, beta                     layers/delta_rule.py, the state carried
    out_proj(rms_norm(o) * norm.weight * act(z))                     per value head; act: silu, or sigmoid
                                                                     (Qwen4-Exp's output_gate_type)

Value heads run in the checkpoint's order (DeltaNetSpec.tiled). Transformers' order is grouped: value head j reads
key head j // r (r value heads per key head). llama.cpp's converter stores qwen35 / qwen35moe tiled: value head j
reads key head j % nK, with every tensor indexed by value head (v's rows, z, b, a, A_log, dt_bias, the conv's v
channels, out_proj's columns) in that one order. Running the heads in the file's order and pairing q / k to match is
the same math with no weight permuted (undoing it would permute out_proj's columns, which splits the 256-value
blocks of a K-quant when a head is 128 wide).

A prompt runs the chunked form of the rule, a decode token the recurrent one. Where the model computes in float32 or
bf16 a prompt's rule is one native call per layer (native/delta_prompt.py, chosen at build: Kernels.native_delta_prompt;
delta_rule.chunked otherwise), and a decode token everything from the conv to the gated norm (native/deltanet.py,
Kernels.native_deltanet; the torch steps otherwise). The state is zeroed when a pass starts at position 0 and must
otherwise continue where the last pass ended: it cannot be rewound (LayerCache.pos; the engine reuses a prompt's
prefix accordingly).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...quant.linear import Q8_MAX_ROWS, QuantLinear
from ...quant.native import delta_prompt
from ...quant.native.deltanet import DeltaNetFused
from ..linear import linear
from ..spec import DELTA_SLICE
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
        self.r = s.delta.n_v_heads // s.delta.n_k_heads  # value heads per key head
        self.tiled = s.delta.tiled and self.r > 1
        # a prompt's rule: one native call where Build chose it (it pairs the unrepeated q / k heads with the value
        # heads in the spec's order itself), else the torch steps of delta_rule.chunked
        self.native_prompt = b.delta_prompt
        # the conv before it natively too (the rule's object runs it: Build chose both), where its weight and state are
        # in the dtype the rule computes in, the conv's activation is silu (the native conv's) and its taps at most
        # CONV_MAX_TAPS (more keep the torch steps)
        self.native_conv = (b.delta_prompt is not None and b.act is F.silu
                            and self.w.conv.dtype is self.cache.conv.dtype is b.delta_prompt.dtype
                            and self.w.conv.shape[-1] <= delta_prompt.CONV_MAX_TAPS)
        self.prompt_rule, self.decode_rule = b.delta_prompt or delta_rule.chunked, delta_rule.recurrent
        # kept-quantized input projections at decode: one native call, x quantized once, their rows over the native
        # threads, bitwise what separate QuantLinear calls give (as Attention's q / k / v); 4 -> 1 call per layer
        w = self.w
        ins = ([w.qkv, w.z] if w.qkvz is None else [w.qkvz]) + ([w.b, w.a] if w.ba is None else [w.ba])
        self.n_qkvz = 2 if w.qkvz is None else 1  # the first outputs of the group are _qkv_z's, the others _b_a's
        self.in_group = QuantLinear.group(ins) if all(type(p) is QuantLinear for p in ins) else None
        self.in_biases = (None,) * len(ins)
        # a decode token from the conv to the gated norm, both states in place (Build.native_deltanet); the kernel
        # pairs q / k with the value heads in the spec's order (grouped or tiled: Build gives it DeltaNetSpec.tiled)
        # and gates with silu: a sigmoid gate (Qwen4-Exp) keeps the torch steps
        native = b.deltanet_decode is not None and self.d.gate_act == "silu"
        self.native = None if not native else b.deltanet_decode.layer(
            self.w.conv, self.cache.conv, self.cache.recurrent, self.neg_A, self.w.dt_bias, self.w.norm, self.eps)
        # ... and, where the input projections are the four of Qwen3.5 grouped, out_proj a kept-quantized weight of
        # its own group and the model bf16, the projections, the step and out_proj in one call: the same C calls on
        # the same values, without the Python between them (native/deltanet.py DeltaNetFused)
        self.fused = None
        o_group = getattr(self.o, "_group", None) if type(self.o) is QuantLinear else None
        if (self.native is not None and self.in_group is not None and w.qkvz is None and w.ba is None
                and o_group is not None and b.dtype is torch.bfloat16 and self.native.owner.dtype is torch.bfloat16):
            self.fused = DeltaNetFused(self.native, self.in_group._q8, o_group._q8, b.compute.planes, b.compute.path)

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        c, T = self.cache, x.shape[0]
        if step.pos == 0:
            c.conv.zero_()
            c.recurrent.zero_()
        elif step.pos != c.pos:
            raise RuntimeError(f"layer {self.L}: its Gated DeltaNet state holds {c.pos} tokens and cannot continue "
                               f"at position {step.pos} (a recurrent state is not rewound; start at 0)")
        out = self._mix(x)
        c.pos = step.pos + T
        return out

    def _mix(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H] after the tokens the states hold, the states moved past x's tokens. A pass longer than
        DELTA_SLICE runs its steps (conv to gated norm) a slice at a time, the states carried from one to the next,
        so the rule's float32 blocks stay bounded; the projections take the whole pass, each weight dequantized
        once (per slice, a 2,048-token prompt dequantized each projection 8 times: 3.8 of 42.5 s in
        benchmarks/results/hybrid/step_profile.txt)."""
        T = x.shape[0]
        if T == 1 and self.fused is not None and x.dtype is torch.bfloat16 and x.is_contiguous():
            return self.fused(x)
        ys = None if self.in_group is None or T > Q8_MAX_ROWS else self.in_group.linear(x, self.in_biases)
        n = self.n_qkvz
        qkv, z = self._qkv_z(x, ys and ys[:n])  # [T, conv_dim], [T, value_dim]
        b, a = self._b_a(x, ys and ys[n:])  # [T, Hv], [T, Hv]
        if T == 1 and self.native is not None:
            o = self.native(qkv.contiguous(), z.contiguous(), b.contiguous(), a.contiguous())  # [1, value_dim]
        elif T <= DELTA_SLICE:
            o = self._steps(qkv, z, b, a).reshape(T, self.d.value_dim)
        else:
            S = DELTA_SLICE
            o = torch.cat([self._steps(qkv[i : i + S], z[i : i + S], b[i : i + S], a[i : i + S])
                           .reshape(-1, self.d.value_dim) for i in range(0, T, S)])
        return linear(o, self.o, None, self.bf16)

    def _steps(self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The torch steps from the projections to the gated norm: [T, Hv, Dv] in x's dtype."""
        d, T = self.d, qkv.shape[0]
        q, k, v = self._conv(qkv).split([d.key_dim, d.key_dim, d.value_dim], dim=-1)
        q, k = q.reshape(T, d.n_k_heads, d.k_head_dim), k.reshape(T, d.n_k_heads, d.k_head_dim)
        rule = self.decode_rule if T == 1 else self.prompt_rule
        if self.tiled and rule is not self.native_prompt:  # value head j reads key head j % nK: the key heads
            q, k = q.repeat(1, self.r, 1), k.repeat(1, self.r, 1)  # repeated as a whole (the rule repeats each one r
            # times in place: grouped order)
        v = v.reshape(T, d.n_v_heads, d.v_head_dim)
        beta = b.sigmoid()
        g = self.neg_A * F.softplus(a.float() + self.w.dt_bias)  # [T, Hv] float32
        o = rule(q, k, v, g, beta, self.cache.recurrent)  # [T, Hv, Dv] in x's dtype
        return gated_rms_norm(o, z.view(T, d.n_v_heads, d.v_head_dim), self.w.norm, self.eps, self.gate_act)

    def _conv(self, qkv: torch.Tensor) -> torch.Tensor:
        """The causal depthwise conv of qkv [T, C] after the layer's last K - 1 inputs, silu -> [T, C]; the last
        K - 1 inputs are kept for the next pass."""
        state, w = self.cache.conv, self.w.conv  # [C, K - 1], [C, 1, K]
        if self.native_conv and qkv.dtype is state.dtype:
            return self.native_prompt.conv(qkv, w, state)
        seq = torch.cat([state, qkv.transpose(0, 1)], dim=1)  # [C, K - 1 + T]
        state.copy_(seq[:, seq.shape[1] - state.shape[1] :])
        out = F.conv1d(seq[None].to(w.dtype), w, groups=w.shape[0])[0]  # [C, T]
        return self.act(out).to(qkv.dtype).transpose(0, 1)

    def _qkv_z(self, x: torch.Tensor, ys: list[torch.Tensor] | None):
        """q | k | v [T, conv_dim] and z [T, value_dim]: Qwen3.5's in_proj_qkv and in_proj_z, or Qwen3-Next's
        in_proj_qkvz, whose rows go key head by key head (per key head: q, k, then its r value heads' v, then
        their z), split into the order of the two. ys: the grouped decode call's outputs for them (in_group's), if
        any."""
        w, d, T = self.w, self.d, x.shape[0]
        if w.qkvz is None:
            return (ys[0], ys[1]) if ys else (linear(x, w.qkv, None, self.bf16), linear(x, w.z, None, self.bf16))
        r, Dk = self.r, d.k_head_dim
        qkvz = ys[0] if ys else linear(x, w.qkvz, None, self.bf16)
        qkvz = qkvz.view(T, d.n_k_heads, 2 * Dk + 2 * r * d.v_head_dim)
        q, k, v, z = qkvz.split([Dk, Dk, r * d.v_head_dim, r * d.v_head_dim], dim=-1)
        qkv = torch.cat([q.reshape(T, d.key_dim), k.reshape(T, d.key_dim), v.reshape(T, d.value_dim)], dim=-1)
        return qkv, z.reshape(T, d.value_dim)

    def _b_a(self, x: torch.Tensor, ys: list[torch.Tensor] | None):
        """b, a [T, Hv] each: Qwen3.5's in_proj_b and in_proj_a, or Qwen3-Next's in_proj_ba, whose rows go key head
        by key head (per key head its r value heads' b, then their a)."""
        w, d, T = self.w, self.d, x.shape[0]
        if w.ba is None:
            return (ys[0], ys[1]) if ys else (linear(x, w.b, None, self.bf16), linear(x, w.a, None, self.bf16))
        ba = ys[0] if ys else linear(x, w.ba, None, self.bf16)
        b, a = ba.view(T, d.n_k_heads, 2 * self.r).split([self.r, self.r], dim=-1)
        return b.reshape(T, d.n_v_heads), a.reshape(T, d.n_v_heads)
