"""y = x @ W^T straight from W's stored bytes (a slot holds an expert exactly as the checkpoint stores it).

This is what the MoE math calls for quantized experts: nothing converts the bytes between the read and the math,
so a miss costs one read and no repacking. Where the native kernels are built and compute the format
(quant/native: GGUF Q4_0-Q8_0, K-quants, MXFP4, MLX 4/8-bit) they run: up to native.kernel.NATIVE_MAX_ROWS rows
straight from the blocks, more rows through a native dequantization into the scratch and one float32 matmul
(the crossover is measured there). Otherwise the torch path below dequantizes the stored blocks into a reusable
float32 scratch (bitwise the reference weights, quant/ggml.py) and runs one float32 matmul; the result is cast to
the compute dtype. In float32 this is the exact reference computation the tests compare with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import native
from .kernels import QuantSpec
from .native.kernel import NativeKernel


class StoredLinear:
    """One projection's matmul from its stored bytes (uint8 [spec.nbytes]) at one compute dtype."""

    def __init__(self, spec: QuantSpec, dtype: torch.dtype, planes: int | None = None):
        """`planes`: the integer path's activation planes (native/kernel.py NativeKernel)."""
        self.spec, self.dtype = spec, dtype
        # the choice is fixed per format, so a streamed and a resident run compute the same way
        ok = native.native_available() and native.supports(spec)
        self.native = NativeKernel(spec, dtype, planes) if ok else None
        if self.native is None and spec.name in native.FORMATS:
            native.warn_unbuilt()

    @property
    def scratch_numel(self) -> int:
        return self.spec.out_features * self.spec.in_features

    def __call__(self, x: torch.Tensor, raw: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> y [T, out] in the compute dtype; `scratch` float32 with >= scratch_numel elements."""
        if self.native is not None:
            return self.native.linear(x, raw, scratch)
        s = self.spec
        w = s.dequantize(raw, out=scratch[: self.scratch_numel].view(s.out_features, s.in_features))
        return F.linear(x.float(), w).to(self.dtype)
