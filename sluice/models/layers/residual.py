"""The residual rule of a decoder layer: pre-norm, x + mixer(norm(x)) then x + ffn(norm(x)), every architecture here
(hyper-connections, several residual streams mixed into the block input, would be another rule beside this one)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...quant import native
from ...quant.native import ops
from .build import Build, Step

Block = Callable[[torch.Tensor, Step], torch.Tensor]  # a mixer or a feed-forward block: (x [T, H], step) -> [T, H]


class PreNorm:
    """One decoder layer: its mixer and its feed-forward block, each behind an RMSNorm and a residual add. Between
    them the step's `after_mixer` (the model's read-ahead of the next MoE layer's experts) sees the residual."""

    def __init__(self, b: Build, L: int, mixer: Block, ffn: Block):
        lw = b.w.layers[L]
        self.L, self.mixer, self.ffn = L, mixer, ffn
        self.input_norm, self.post_norm = b.norm(lw.input_norm), b.norm(lw.post_norm)
        # a prompt's bf16 residual adds in one native call over the pool (torch's bf16 add took 1.0 ms a [2,048 x
        # 1,024] on AVX2, 32 ms of a 2,048-token prompt of the peers model: benchmarks/quantized/prompt_profile.py,
        # benchmarks/results/quantized/breakdown/prompt-profile-2.txt), the same bits
        self.path = b.compute.path if native.available() else None

    def _add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if (self.path is not None and x.shape[0] > 1 and x.dtype is y.dtype is torch.bfloat16 and x.is_contiguous()
                and y.is_contiguous() and x.shape == y.shape):
            return ops.add_bf16(x, y, path=self.path)
        return x + y

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        x = self._add(x, self.mixer(self.input_norm(x), step))
        if step.after_mixer is not None:
            step.after_mixer(self.L, x, step)
        return self._add(x, self.ffn(self.post_norm(x), step))
