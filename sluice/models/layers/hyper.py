"""Hyper-connections, the residual rule of qwen4_exp (beside residual.py's PreNorm): the residual is n = hc_count
streams of H values each, side by side ([T, n*H]), and each block reads a mix of them and writes into each.

    xn       = the streams' RMSNorm, each stream on its own (one zero-centred weight [n*H])
    mix      = sigmoid(up(silu(down(xn) / n)))          [T, n*H]: a low-rank (hc_lowrank) weight per value
    input    = mean over the streams of mix * xn        [T, H]: what the block (mixer, feed-forward) runs on
    inject   = 2 * sigmoid(block_inject(xn) / n)        [T, n]: how much of its output each stream takes
    streams += out[:, None, :] * inject[..., None]      the streams before the norm, plus the block's output

A layer does that twice (into the mixer, then into the feed-forward block), after its PLE block when it has one.
The model enters with n copies of the embedding and leaves through a last mix (no inject), which replaces the final
norm before the head. Every op runs in the compute dtype, in the reference's order (transformers' Qwen4Exp
GatedResidual), so bf16 rounds where it does.

A prompt's mix and inject run in slices of HC_SLICE rows (each row's ops are its own: the same math as one call,
up to the order a GEMM sums a row in, which may change with the row count).
Over a whole 2,140-token pass each of the ~12 ops makes a [T, n*H] temporary of 35-70 MB: fresh pages from the
allocator (~137,000 minor faults a mix) streamed through memory; a slice's stay in cache and are reused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..linear import linear
from ..spec import HyperWeights
from .build import Build, Step
from .residual import Block

# rows of a prompt a mix / inject runs on at once. One mix + inject at qwen4_exp's n = 4, H = 2048, rank 320, bf16,
# 2,140 rows, 2-core AVX512_BF16 EPYC (the other core busy): whole 269-285 ms, 137,000 minor faults; slices of 32 /
# 64 / 256 rows 124 / 113 / 102 ms, 8,600-10,800 faults (`benchmarks/ple/hyper_slices.py`)
HC_SLICE = 256


def _slices(T: int) -> list[tuple[int, int]]:
    """[0, T) in ceil(T / HC_SLICE) near-equal slices (no short last one: every slice runs the many-row GEMM)."""
    k = -(-T // HC_SLICE)
    edges = [T * i // k for i in range(k + 1)]
    return list(zip(edges[:-1], edges[1:]))


class HyperConnection:
    """One mix of the n streams into a block's input (`__call__` -> (input [T, H], inject [T, n] or None))."""

    def __init__(self, b: Build, w: HyperWeights):
        self.n, self.H, self.w, self.bf16 = b.spec.hc_count, b.spec.hidden_size, w, b.compute.bf16_gemm
        self.norm = b.norm(w.norm, group=self.H)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = x.shape[0]
        if T <= HC_SLICE:
            return self._mix(x)
        block_in = x.new_empty(T, self.H)  # [T, H]
        weights = x.new_empty(T, self.n) if self.w.inject is not None else None  # [T, n]
        for a, b in _slices(T):
            h, wt = self._mix(x[a:b])
            block_in[a:b] = h
            if weights is not None:
                weights[a:b] = wt
        return block_in, weights

    def _mix(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        T, n, H, w = x.shape[0], self.n, self.H, self.w
        xn = self.norm(x)  # [T, n*H]
        mix = F.silu(linear(xn, w.down, None, self.bf16) / n)  # [T, r]
        mix = torch.sigmoid(linear(mix, w.up, None, self.bf16))  # [T, n*H]
        block_in = (mix.view(T, n, H) * xn.view(T, n, H)).mean(dim=-2)  # [T, H]
        if w.inject is None:
            return block_in, None
        return block_in, 2 * torch.sigmoid(linear(xn, w.inject, None, self.bf16) / n)  # [T, n]


def inject(x: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The streams x [T, n*H] plus the block's output [T, H] scaled per stream by weights [T, n] (in slices of a
    prompt's rows: elementwise, the same bits)."""
    T = x.shape[0]
    if T <= HC_SLICE:
        return x + _per_stream(out, weights)
    y = torch.empty_like(x)
    for a, b in _slices(T):
        torch.add(x[a:b], _per_stream(out[a:b], weights[a:b]), out=y[a:b])
    return y


def _per_stream(out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out [T, H] scaled by each stream's weight [T, n] -> [T, n*H]."""
    return (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)


class HyperLayer:
    """One decoder layer under hyper-connections: [PLE block,] mixer and feed-forward block, each behind its own
    hyper-connection: x [T, n*H] -> [T, n*H]. `ple`: a block x [T, n*H] -> [T, n*H] added to the streams first.
    No read-ahead of the next layer's experts here (the prerouters read a plain residual)."""

    def __init__(self, b: Build, L: int, mixer: Block, ffn: Block, ple: Block | None = None):
        lw = b.w.layers[L]
        self.L, self.mixer, self.ffn, self.ple = L, mixer, ffn, ple
        self.attn_hc, self.mlp_hc = HyperConnection(b, lw.hc_attn), HyperConnection(b, lw.hc_mlp)

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        if self.ple is not None:
            x = x + self.ple(x, step)
        h, weights = self.attn_hc(x)
        x = inject(x, self.mixer(h, step), weights)
        h, weights = self.mlp_hc(x)
        return inject(x, self.ffn(h, step), weights)


class Streams:
    """How the hidden state enters the streams (n copies of the embedding) and leaves them (the final mix)."""

    def __init__(self, b: Build):
        self.n = b.spec.hc_count
        self.mixer = HyperConnection(b, b.w.hc_mixer)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, n*H]."""
        return x.repeat(1, self.n)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, n*H] -> the mixed [T, H] the head reads."""
        return self.mixer(x)[0]
