"""How one projection's weight is stored (`QuantSpec`) and the parts of its bytes in a slot (`Part`).

    spec = QuantSpec.ggml("Q4_K", out_features=768, in_features=2048)     # or .mlx(...), .mxfp4(...), .fp8(...)
    spec.parts, spec.nbytes          # the stored byte ranges, laid out in one buffer (64-byte aligned parts)
    spec.dequantize(raw)             # the exact float32 weights (the reference, bitwise gguf / mx.dequantize)

The math on them is quant/linear.py (a weight's row-count ladder: native kernels from the stored bytes, or
dequantize + one matmul) and models/layers/experts.py (a slot's experts).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..checkpoint.formats import BY_NAME, MLX_BITS, UnsupportedFormat
from .affine import Affine
from .ggml import DEQUANTIZABLE
from .ggml import affine as ggml_affine
from .fp8 import SCALE_DTYPES as FP8_SCALE_DTYPES
from .fp8 import block_grid, dequantize_fp8
from .mlx import mlx_affine
from .mxfp4 import mxfp4_affine

_ALIGN = 64  # byte alignment of each part inside a buffer (any tensor view of it is aligned)

def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class Part:
    """One tensor inside a byte buffer: its name, byte offset, dtype and shape."""

    name: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n

    def view(self, buf: torch.Tensor) -> torch.Tensor:
        """This part of a uint8 buffer as a typed tensor (a view, no copy)."""
        return buf[self.offset: self.offset + self.nbytes].view(self.dtype).view(self.shape)


def _layout(parts: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[tuple[Part, ...], int]:
    out, at = [], 0
    for name, dtype, shape in parts:
        p = Part(name, at, dtype, tuple(shape))
        out.append(p)
        at = _aligned(at + p.nbytes)
    last = out[-1]
    return tuple(out), last.offset + last.nbytes


@dataclass(frozen=True)
class QuantSpec:
    """How one projection weight [out_features, in_features] is stored, and the parts of its bytes.

    family: "ggml" (name = a GGUF type name: F32, BF16, Q4_K, ...; one part "blocks" [out, row bytes]),
    "mlx" (affine; parts "weight" uint32, "scales", "biases" [out, in/group_size] in scale_dtype),
    "mxfp4" (gpt-oss; parts "blocks" uint8 [out, in/32, 16] and "scales" uint8 [out, in/32]) or
    "fp8" (name "fp8_e4m3": parts "weight" float8_e4m3fn [out, in] and "scales" [ceil(out/block_rows),
    ceil(in/group_size)] in scale_dtype: the `weight_scale_inv` of quant/fp8.py, one per block of block_rows x
    group_size weights).
    `parts` are laid out one after another in a buffer of `nbytes` bytes, each at a 64-byte aligned offset: the
    store reads each byte range of the checkpoint into its part of the buffer.
    """

    family: str
    name: str
    out_features: int
    in_features: int
    bits: int = 0
    group_size: int = 0
    scale_dtype: torch.dtype | None = None
    block_rows: int = 0  # fp8: the rows of one scale's block (weight_block_size[0])

    @staticmethod
    def ggml(name: str, out_features: int, in_features: int) -> "QuantSpec":
        """A GGUF tensor of type `name`; UnsupportedFormat for a type sluice cannot compute, ValueError for a row
        length that is not whole blocks."""
        f = BY_NAME.get(name)
        if f is None or name not in DEQUANTIZABLE:
            raise UnsupportedFormat(name, "sluice has no kernel for it" if f else "it is not a ggml type")
        f.row_nbytes(in_features)  # raises for a row that is not whole blocks
        return QuantSpec("ggml", name, out_features, in_features)

    @staticmethod
    def mlx(bits: int, group_size: int, out_features: int, in_features: int,
            scale_dtype: torch.dtype = torch.bfloat16) -> "QuantSpec":
        """An MLX affine-quantized Linear (config.json quantization {bits, group_size})."""
        if bits not in MLX_BITS or group_size <= 0 or in_features % group_size or in_features * bits % 32:
            raise ValueError(f"MLX quantization bits={bits} group_size={group_size} does not fit rows of "
                             f"{in_features} (bits in {MLX_BITS}, rows whole groups and whole uint32 words)")
        return QuantSpec("mlx", f"mlx{bits}", out_features, in_features, bits, group_size, scale_dtype)

    @staticmethod
    def mxfp4(out_features: int, in_features: int) -> "QuantSpec":
        """A gpt-oss MXFP4 weight (`*_blocks` and `*_scales`)."""
        if in_features % 32:
            raise ValueError(f"MXFP4 rows are whole groups of 32, got {in_features}")
        return QuantSpec("mxfp4", "mxfp4", out_features, in_features, 4, 32)

    @staticmethod
    def fp8(out_features: int, in_features: int, block: tuple[int, int] = (128, 128),
            scale_dtype: torch.dtype = torch.float32) -> "QuantSpec":
        """An FP8 e4m3 weight with its block scales (`weight` + `weight_scale_inv`, quant/fp8.py), blocks of
        block = (rows, inputs). ValueError for rows or blocks the kernels cannot take: rows of whole groups of 32
        inputs, blocks of whole groups of 32 inputs (one scale per group), scales in F32 / BF16 / F16."""
        bn, bk = block
        if (type(bn) is not int or type(bk) is not int or bn < 1 or bk < 32 or bk % 32 or bn >= 2**23
                or in_features % 32 or scale_dtype not in FP8_SCALE_DTYPES):
            raise ValueError(f"FP8 weights [{out_features}, {in_features}] in blocks {list(block)} with "
                             f"{scale_dtype} scales: sluice computes rows of whole groups of 32 inputs, blocks of "
                             "whole groups of 32 inputs and float32 / bfloat16 / float16 scales")
        return QuantSpec("fp8", "fp8_e4m3", out_features, in_features, 8, bk, scale_dtype, bn)

    @property
    def block(self) -> tuple[int, int]:
        """fp8: (rows, inputs) of one scale's block."""
        return self.block_rows, self.group_size

    @property
    def parts(self) -> tuple[Part, ...]:
        return self._layout()[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as stored (all parts, with the alignment padding between them)."""
        return self._layout()[1]

    def _layout(self) -> tuple[tuple[Part, ...], int]:
        return _spec_layout(self)

    def _build_layout(self) -> tuple[tuple[Part, ...], int]:
        o, i = self.out_features, self.in_features
        if self.family == "ggml":
            return _layout([("blocks", torch.uint8, (o, BY_NAME[self.name].row_nbytes(i)))])
        if self.family == "mlx":
            g = i // self.group_size
            return _layout([("weight", torch.int32, (o, i * self.bits // 32)), ("scales", self.scale_dtype, (o, g)),
                            ("biases", self.scale_dtype, (o, g))])
        if self.family == "fp8":
            return _layout([("weight", torch.float8_e4m3fn, (o, i)),
                            ("scales", self.scale_dtype, block_grid((o, i), self.block))])
        return _layout([("blocks", torch.uint8, (o, i // 32, 16)), ("scales", torch.uint8, (o, i // 32))])

    def affine(self, raw: torch.Tensor, codes: bool = True) -> Affine:
        """The stored bytes (uint8 [nbytes]) unpacked into codes, scales and biases (not for plain ggml types, nor
        fp8, whose scales cover blocks of rows);
        codes=False leaves the codes packed (Affine.codes None)."""
        v = {p.name: p.view(raw) for p in self.parts}
        if self.family == "ggml":
            return ggml_affine(v["blocks"], self.name, codes=codes)
        if self.family == "fp8":
            raise ValueError("FP8 block scales cover blocks of rows and inputs, not an affine group of one row")
        if self.family == "mlx":
            return mlx_affine(v["weight"], v["scales"], v["biases"], bits=self.bits, group_size=self.group_size,
                              codes=codes)
        return mxfp4_affine(v["blocks"], v["scales"])

    def dequantize(self, raw: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The exact float32 weights [out, in] of the stored bytes (the reference every kernel is measured against)."""
        if self.plain:
            w = self.parts[0].view(raw).view(_PLAIN[self.name])
            return w.float() if out is None else out.view(w.shape).copy_(w)
        if self.family == "fp8":
            w, scales = (p.view(raw) for p in self.parts)
            return dequantize_fp8(w, scales, self.block, out=out).view(w.shape)
        return self.affine(raw).dequantize(out)

    @property
    def plain(self) -> bool:
        return self.family == "ggml" and self.name in _PLAIN


_PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@functools.lru_cache(maxsize=4096)
def _spec_layout(spec: QuantSpec) -> tuple[tuple[Part, ...], int]:
    """spec's parts and bytes, made once per spec: QuantLinear asks for nbytes on every call (a decode token's ~200
    projections; building the parts each time took ~5 us a call)."""
    return spec._build_layout()
