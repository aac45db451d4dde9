"""Quantized tensor formats -> math: how a weight is stored, its exact dequantization, the kernels on its bytes.

    from sluice.quant import QuantSpec, UnsupportedFormat
    spec = QuantSpec.ggml("Q4_K", 768, 2048)          # a GGUF tensor type (ggml name), or
    spec = QuantSpec.mlx(4, 64, 768, 2048, torch.bfloat16)   # MLX affine: bits, group_size, scales' dtype, or
    spec = QuantSpec.mxfp4(768, 2048)                  # gpt-oss *_blocks / *_scales, or
    spec = QuantSpec.fp8(768, 2048, (128, 128))        # FP8 e4m3 weight + weight_scale_inv (DeepSeek-V3, Qwen3 FP8)
    spec.parts, spec.nbytes     # the stored byte ranges of one projection, laid out in one buffer (64-byte aligned)
    spec.dequantize(raw)        # the exact float32 weights (the reference, bitwise gguf / mx.dequantize)

    compute.py   Compute: a model's kernel settings (dtype, bf16 GEMMs, activation coding, path cap, threads)
    linear.py    StoredLinear / QuantLinear: one weight's row-count ladder, written once (native kernels from the
                 stored bytes, or dequantize + one GEMM)
    matmul.py    how several bf16 rows multiply plain bf16 weights (rows_linear, packed weights, a prompt's sdpa)
    native/      the C kernels, one thin wrapper per C file
    tensor.py    read_tensor: one whole tensor read and dequantized (resident weights)
    fp8.py       FP8 block-scaled weights: the reference dequantization (bitwise transformers') and quantizer
    ggml.py, mlx.py, mxfp4.py, affine.py   the reference dequantizations (bitwise gguf / mx.dequantize); ggml.py
                 dispatches every GGUF type: ggml_k.py (Q2_K, Q3_K, TQ*), ggml_iq.py (IQ*, with ggml_grids.py's
                 tables), ggml_bits.py (the block fields they share)

Errors: a type sluice cannot compute raises `UnsupportedFormat` (a ValueError whose `.format` is the type name and
whose message names it and says what to do); byte counts or shapes that do not fit the format raise ValueError.
Neither knows the file or tensor: the checkpoint reader wraps both into `CheckpointError(str(err), file=...,
tensor=...)`.
"""

from ..checkpoint.formats import UnsupportedFormat
from .spec import Part, QuantSpec

__all__ = ["Part", "QuantSpec", "UnsupportedFormat"]
