"""Quantized tensor formats -> math: the format table, reference-exact dequantization, packed CPU kernels.

What the rest of sluice calls (all functional, no files; shapes are [out_features, in_features] = [N, K]):

    from sluice.quant import QuantSpec, kernel_for, UnsupportedFormat

    spec = QuantSpec.ggml("Q4_K", 768, 2048)          # a GGUF tensor type (ggml name), or
    spec = QuantSpec.mlx(4, 64, 768, 2048, torch.bfloat16)   # MLX affine: bits, group_size, scales' dtype, or
    spec = QuantSpec.mxfp4(768, 2048)                  # gpt-oss *_blocks / *_scales
    spec.parts, spec.nbytes     # the stored byte ranges of one expert's projection, laid out in one buffer
                                # (Part(name, offset, dtype, shape); 64-byte aligned offsets)
    k = kernel_for(spec, dtype) # dtype = the model's compute dtype; float32 -> the exact path
    k.name                      # "int4pack" | "affine" | "plain"
    k.nbytes                    # bytes of the prepared form = the slot size for this projection, fixed
    k.scratch_numel             # float32 scratch elements linear() may use (one scratch, the max over kernels)
    k.prepare(raw, slot)        # read workers: stored bytes uint8 [spec.nbytes] -> slot uint8 [k.nbytes], in place
    y = k.linear(x, slot, scratch)   # x [T, K] in dtype -> y [T, N] in dtype
    w = k.dequantize(slot, scratch)  # the float32 weights the kernel computes with (a view of scratch)
    spec.dequantize(raw)        # the exact float32 weights (the reference, bitwise gguf / mx.dequantize)

Native kernels (sluice/quant/native, C built at install; what stored.StoredLinear runs for the experts when built):
`native.linear(spec, x, raw)` computes y from the stored bytes themselves (no prepare step, the slot is the file's
bytes), from exactly dequantized weights with float32 FMA dots; `native.native_available()` is False without a
compiler at install, and the torch paths above run instead. See native/__init__.py and native/kernel.py.

Lower level, for the checkpoint readers and tests:
- `ggml.dequantize(raw, "Q4_K", shape=None, out=None)`: raw block bytes -> float32 (or rounded once into out's
  bf16/f16), bitwise `gguf.quants.dequantize`; `ggml.DEQUANTIZABLE` lists the types.
- `mlx.dequantize_mlx(weight, scales, biases, bits=, group_size=)`, `mxfp4.dequantize_mxfp4(blocks, scales)`.
- `formats`: the ggml type table (BY_ID, BY_NAME, SUPPORTED) and `UnsupportedFormat`.

Errors: a type sluice cannot compute raises `UnsupportedFormat` (a ValueError whose `.format` is the type name and
whose message names it and says what to do); byte counts or shapes that do not fit the format raise ValueError.
Neither knows the file or tensor: the checkpoint reader wraps both into `CheckpointError(str(err), file=...,
tensor=...)`.

Exactness: float32 kernels compute F.linear on the reference dequantization, bit for bit; the int4 kernel (bf16 /
f16 compute) rounds each group's scale and zero to bf16, ~2e-3 relative L2 on the weights and ~3e-3 on the output
with bf16 activations (issue 14 allows 3e-2 for the default dtype). Measured speeds are in kernels.py.
"""

from ..checkpoint.formats import UnsupportedFormat
from .kernels import Kernel, Part, QuantSpec, kernel_for

__all__ = ["Kernel", "Part", "QuantSpec", "UnsupportedFormat", "kernel_for"]
