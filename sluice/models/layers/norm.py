"""RMSNorm as the references compute it: `rms_norm` (statistics in float32, cast back, then scale), `Norm` (one
weight, plain or zero-centred, over the whole row or per group of it, chosen when the layer is built) and
`gated_rms_norm` (Gated DeltaNet's output norm)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...quant import native
from ...quant.native import BEST, ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, path: int = BEST) -> torch.Tensor:
    """RMSNorm of x [..., n] by weight [n]. bf16 rows go through one native call (ops.rms_norm_bf16: ~6 us against
    ~36 for these eight torch ops at one 1024-wide row, and a decode token of a 16-layer model with q/k norms runs 65
    of them; the same bits but for the last bit of a row's scale); `path`: the model's Compute.path."""
    if (x.dtype is torch.bfloat16 and weight.dtype is torch.bfloat16 and native.available() and x.is_contiguous()
            and weight.is_contiguous()):
        return ops.rms_norm_bf16(x, weight, eps, path=path)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Norm:
    """The RMSNorm of one weight as the architecture scales it (Spec.zero_centred_norms): x [..., n] -> [..., n].

    Plain: `rms_norm` (the normed x rounded to the compute dtype, then times the weight). Zero-centred (Qwen3-Next,
    Qwen3.5): the scale is 1 + weight, computed once here in float32, and the normed x is multiplied by it in
    float32 before the one rounding to the compute dtype: the reference's order, so bf16 rounds where it does (bf16
    rows of an ungrouped norm in one native call, ops.rms_norm_scaled_bf16, as rms_norm's).

    `group`: each run of `group` values of a row normalised on its own (hyper-connections' streams: n streams of H
    side by side, one weight [n*H]); zero-centred only (the one family that has it)."""

    def __init__(self, weight: torch.Tensor, eps: float, path: int = BEST, zero_centred: bool = False,
                 group: int | None = None):
        if group is not None and (not zero_centred or weight.shape[-1] % group):
            raise ValueError(f"a grouped norm is zero-centred over whole groups: {weight.shape[-1]} by {group}")
        self.eps, self.path, self.zero_centred, self.group = eps, path, zero_centred, group
        self.weight = 1.0 + weight.float() if zero_centred else weight  # the scale [n]

    @classmethod
    def of(cls, spec, weight: torch.Tensor, path: int = BEST, group: int | None = None) -> "Norm":
        """The norm of `weight` in a model of `spec` (models/spec.py Spec: its eps and zero_centred_norms)."""
        return cls(weight, spec.rms_norm_eps, path, spec.zero_centred_norms, group)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.zero_centred:
            return rms_norm(x, self.weight, self.eps, self.path)
        if self.group is None and x.dtype is torch.bfloat16 and native.available() and x.is_contiguous():
            return ops.rms_norm_scaled_bf16(x, self.weight, self.eps, path=self.path)
        xf = x.float()
        if self.group is not None:
            g = xf.unflatten(-1, (-1, self.group))  # [..., n, group]
            xf = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        else:
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   act=F.silu) -> torch.Tensor:
    """Gated DeltaNet's output norm: rms_norm(x) * weight * act(gate) over the last dim (act: silu, or Qwen4-Exp's
    sigmoid), in the reference's order (the normed x rounded to x's dtype and scaled there, the gate applied in
    float32, one rounding back)."""
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed * act(gate.float())).to(x.dtype)
