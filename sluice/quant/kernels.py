"""One projection's weight as stored -> the form a slot holds -> y = x @ W^T. What the store and the MoE block call.

    spec = QuantSpec.ggml("Q4_K", out_features=768, in_features=2048)     # or .mlx(...), .mxfp4(...)
    k = kernel_for(spec, torch.bfloat16)      # the kernel for this format and compute dtype
    k.prepare(raw, slot)                      # read workers: raw uint8 [spec.nbytes] -> slot uint8 [k.nbytes]
    y = k.linear(x, slot, scratch)            # x [T, in] -> y [T, out] in dtype; scratch: float32 [>= k.scratch_numel]

Kernels:
- "int4pack" (compute dtype bf16/f16; Q4_0, Q4_1, Q4_K, MLX 4-bit, rows a multiple of 16): the slot holds torch's
  packed int4 codes and a bf16 scale/zero per group; up to INT4_MAX_ROWS rows run `aten._weight_int4pack_mm_for_cpu`,
  more rows dequantize the same packed weights into the float32 scratch and run one float32 matmul. Not exact:
  scales and zeros are rounded to bf16 (weights 1.7e-3 relative L2 from the exact ones; outputs 2.9e-3 with bf16
  activations, the same as a bf16 copy of the exact weights gives: 2.9e-3).
- "affine" (every other format, and every format at float32): the slot holds the unpacked codes (1 byte each) and
  float32 scale (and bias) per group, i.e. the format's bit twiddling is done once in `prepare`; `linear` applies the
  scales into the scratch (two or three passes) and runs a float32 matmul. At float32 this is exact: the scratch
  holds the reference dequantization bit for bit (gguf / mx.dequantize), see affine.py.
- "plain" (F32 / F16 / BF16): the slot holds the bytes as stored; widened into the scratch unless already float32.

Measured (benchmarks/quant_kernels.py, removed: its command is in benchmarks/results/README.md; the table is
results/quant_kernels.md): ms per expert y = down(silu(gate x) * up x), H=2048 x I=768 (Qwen3-30B-A3B), one thread,
thread CPU time, median of 21 interleaved rounds, on the shared 2-core AMD EPYC (Zen 3, AVX2, no AVX-512/AMX) dev
VM at load ~10. An earlier run at load 13 gave the dequantizing arms 20-40% lower and the op / dense arms within
20%: the ranking is stable, the values are not; re-measure quiet.

| arm                                      | T=1         | T=4         | T=128       |
|------------------------------------------|-------------|-------------|-------------|
| dense bf16 F.linear (today's bf16 path)  | 1.80        | 5.00        | 134.4       |
| dense f32 F.linear                       | 2.26        | 5.52        | 29.0        |
| Q4_K int4pack: the op                    | 1.39        | 2.35        | 49.8        |
| Q4_K int4pack: -> f32 scratch + f32 mm   | 18.4        | 21.3        | 48.0        |
| Q4_K affine (f32 scratch)                | 7.76        | 11.3        | 38.5        |
| Q4_K affine, bf16 scratch + bf16 mm      | 12.5        | 16.7        | 146.8       |
| Q4_K stored bytes dequantized per call   | 27.0        | 25.3        | -           |
| Q6_K affine / stored bytes per call      | 5.96 / 45.4 | 11.0 / 38.2 | 36.1 / 56.4 |
| Q8_0 affine / stored bytes per call      | 5.76 / 12.0 | 9.59 / 14.9 | 36.3 / 39.1 |
| int8pack (per-channel only: no Q8_0 fit) | 1.68        | 2.46        | 44.5        |

prepare() per [768 x 2048] projection: Q4_K int4pack 2.8 ms (its packing 1.8 ms; torch's own route from unpacked
codes through int32 and the op: 6.8 ms), Q4_K affine 2.9, Q6_K affine 5.8, Q8_0 affine 1.3.

The slot layout of each kernel is fixed by (spec, dtype), so slot buffers are allocated once at `k.nbytes` and
`prepare` writes them in place. `prepare` does allocate temporaries (the unpacking passes: 4.3 MB for a Q4_K
[768 x 2048] int4pack, 9.9 MB for Q6_K affine); it runs in the read workers, off the decode critical path, but on a
2-core machine it competes with the math: ~8 ms of CPU per missed Q4_K expert against ~1 ms to read its 2.6 MB.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import int4pack
from .affine import Affine, apply_affine
from .formats import BY_NAME, UnsupportedFormat
from .ggml import DEQUANTIZABLE
from .ggml import affine as ggml_affine
from .mlx import BITS as MLX_BITS
from .mlx import mlx_affine
from .mxfp4 import mxfp4_affine

_ALIGN = 64  # byte alignment of each part inside a buffer (any tensor view of it is aligned)

# Rows (tokens routed to one expert) above which the int4 path dequantizes into the float32 scratch and runs one
# float32 matmul instead of the packed op, which re-unpacks the weights for every 4 rows of x. One [768 x 2048] Q4_K
# projection, ms (op / dequantize + f32 matmul), dev VM, one thread, CPU time, two runs: T=1 0.37 / 3.5-4.1,
# T=16 1.5-2.3 / 4.3-7.5, T=32 3.0-4.3 / 5.9-8.2, T=64 8.2-8.3 / 9.5-10.8, T=128 14.3-15.7 / 12.4-12.5.
INT4_MAX_ROWS = 64

# The dequantizing kernels write float32 weights into the scratch and run a float32 matmul, also for bf16 compute:
# without native bf16 (AVX2, no avx512_bf16 / AMX) torch's bf16 matmul is 2x (1 row) to 12x (128 rows) slower than
# float32 on the same weights (dev VM, benchmarks/quant_kernels.py, removed: benchmarks/results/README.md), and
# float32 is the more exact of the two.
# TODO: measure a bf16 scratch on an AMX machine, where bf16 matmuls are the fast ones.


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
    "mlx" (affine; parts "weight" uint32, "scales", "biases" [out, in/group_size] in scale_dtype) or
    "mxfp4" (gpt-oss; parts "blocks" uint8 [out, in/32, 16] and "scales" uint8 [out, in/32]).
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

    @property
    def parts(self) -> tuple[Part, ...]:
        return self._layout()[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as stored (all parts, with the alignment padding between them)."""
        return self._layout()[1]

    def _layout(self) -> tuple[tuple[Part, ...], int]:
        o, i = self.out_features, self.in_features
        if self.family == "ggml":
            return _layout([("blocks", torch.uint8, (o, BY_NAME[self.name].row_nbytes(i)))])
        if self.family == "mlx":
            g = i // self.group_size
            return _layout([("weight", torch.int32, (o, i * self.bits // 32)), ("scales", self.scale_dtype, (o, g)),
                            ("biases", self.scale_dtype, (o, g))])
        return _layout([("blocks", torch.uint8, (o, i // 32, 16)), ("scales", torch.uint8, (o, i // 32))])

    def affine(self, raw: torch.Tensor, codes: bool = True) -> Affine:
        """The stored bytes (uint8 [nbytes]) unpacked into codes, scales and biases (not for plain ggml types);
        codes=False leaves the codes packed (Affine.codes None)."""
        v = {p.name: p.view(raw) for p in self.parts}
        if self.family == "ggml":
            return ggml_affine(v["blocks"], self.name, codes=codes)
        if self.family == "mlx":
            return mlx_affine(v["weight"], v["scales"], v["biases"], bits=self.bits, group_size=self.group_size,
                              codes=codes)
        return mxfp4_affine(v["blocks"], v["scales"])

    def nibbles(self, raw: torch.Tensor) -> tuple[torch.Tensor, int]:
        """4-bit formats: (the stored code bytes as int4pack.pack_nibbles takes them, the offset subtracted from a
        stored code in the Affine form: 8 for Q4_0, else 0)."""
        v = {p.name: p.view(raw) for p in self.parts}
        if self.name == "mlx4":
            return v["weight"].view(torch.uint8).view(self.out_features, -1, 1), 0
        blocks = v["blocks"].view(self.out_features, -1, BY_NAME[self.name].block_bytes)
        if self.name == "Q4_K":
            return blocks[..., 16:].unflatten(-1, (4, 32)), 0  # [N, blocks, 4, 32]
        return blocks[..., 2:] if self.name == "Q4_0" else blocks[..., 4:], 8 if self.name == "Q4_0" else 0

    def dequantize(self, raw: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The exact float32 weights [out, in] of the stored bytes (the reference every kernel is measured against)."""
        if self.plain:
            w = self.parts[0].view(raw).view(_PLAIN[self.name])
            return w.float() if out is None else out.view(w.shape).copy_(w)
        return self.affine(raw).dequantize(out)

    @property
    def plain(self) -> bool:
        return self.family == "ggml" and self.name in _PLAIN


_PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_INT4 = {"Q4_0", "Q4_1", "Q4_K", "mlx4"}


class Kernel:
    """y = x @ W^T for one QuantSpec at one compute dtype; see the module docstring. Subclasses set `parts`."""

    name = ""

    def __init__(self, spec: QuantSpec, dtype: torch.dtype):
        self.spec = spec
        self.dtype = dtype
        self.parts, self.nbytes = self._parts()

    @property
    def scratch_numel(self) -> int:
        """Elements of the float32 scratch `linear` needs (one projection's weights); one scratch of the largest
        projection's size serves every kernel, since each linear call is done with it when it returns."""
        return self.spec.out_features * self.spec.in_features

    def views(self, slot: torch.Tensor) -> dict[str, torch.Tensor]:
        return {p.name: p.view(slot) for p in self.parts}

    def _check(self, buf: torch.Tensor, nbytes: int, what: str) -> None:
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < nbytes or not buf.is_contiguous():
            raise ValueError(f"{what} must be a contiguous 1-D uint8 buffer of at least {nbytes} bytes for "
                             f"{self.spec.name} [{self.spec.out_features}, {self.spec.in_features}], got "
                             f"{buf.dtype} {tuple(buf.shape)}")

    def prepare(self, raw: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Writes the slot form of the stored bytes raw (uint8 [spec.nbytes]) into slot (uint8 [>= nbytes]);
        returns slot."""
        self._check(raw, self.spec.nbytes, "raw")
        self._check(slot, self.nbytes, "slot")
        self._prepare(raw, slot)
        return slot

    def linear(self, x: torch.Tensor, slot: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        """y [T, out] = x [T, in] @ W^T, W the prepared weights in slot; x and y in the kernel's dtype."""
        raise NotImplementedError

    def dequantize(self, slot: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        """The float32 weights [out, in] this kernel computes with, written into scratch (float32, >= scratch_numel
        elements); returns them as a view of scratch (possibly a transposed one)."""
        raise NotImplementedError

    def _matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(w.dtype), w).to(self.dtype)

    def __repr__(self) -> str:
        s = self.spec
        return f"{type(self).__name__}({s.name} [{s.out_features}, {s.in_features}], {self.dtype})"


class PlainKernel(Kernel):
    name = "plain"

    def _parts(self):
        return self.spec.parts, self.spec.nbytes

    def _prepare(self, raw, slot):
        slot[: self.nbytes].copy_(raw[: self.nbytes])

    def dequantize(self, slot, scratch):
        w = self.parts[0].view(slot).view(_PLAIN[self.spec.name])
        if w.dtype == torch.float32:
            return w
        return scratch[: self.scratch_numel].view(w.shape).copy_(w)

    def linear(self, x, slot, scratch):
        return self._matmul(x, self.dequantize(slot, scratch))


class AffineKernel(Kernel):
    name = "affine"

    def _parts(self):
        s = self.spec
        groups = s.in_features // self._group()
        code_dtype = torch.uint8 if self._unsigned() else torch.int8
        parts = [("codes", code_dtype, (s.out_features, s.in_features)),
                 ("scale", torch.float32, (s.out_features, groups))]
        if self._biased():
            parts.append(("bias", torch.float32, (s.out_features, groups)))
        return _layout(parts)

    def _group(self) -> int:
        s = self.spec
        return 16 if s.name == "Q6_K" else s.group_size if s.family == "mlx" else 32

    def _unsigned(self) -> bool:
        return self.spec.name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") or self.spec.family == "mlx"

    def _biased(self) -> bool:
        return self._unsigned()

    def _prepare(self, raw, slot):
        a = self.spec.affine(raw)
        v = self.views(slot)
        v["codes"].copy_(a.codes)
        v["scale"].copy_(a.scale)
        if a.bias is not None:
            v["bias"].copy_(a.bias)

    def dequantize(self, slot, scratch):
        v = self.views(slot)
        w = scratch[: self.scratch_numel].view(self.spec.out_features, self.spec.in_features)
        return apply_affine(v["codes"], v["scale"], v.get("bias"), self._group(), w)

    def linear(self, x, slot, scratch):
        return self._matmul(x, self.dequantize(slot, scratch))


class Int4PackKernel(Kernel):
    name = "int4pack"

    def _parts(self):
        s = self.spec
        return _layout([("packed", torch.uint8, (s.out_features, s.in_features // 2)),
                        ("sz", torch.bfloat16, (s.in_features // self.group, s.out_features, 2))])

    @property
    def group(self) -> int:
        return self.spec.group_size if self.spec.family == "mlx" else 32

    def _prepare(self, raw, slot):
        # straight from the stored nibbles, no codes tensor: 2.5-2.8 ms per [768 x 2048] Q4_K projection against
        # 4.4 ms through the unpacked codes (dev VM, thread CPU time)
        a = self.spec.affine(raw, codes=False)
        qs, offset = self.spec.nibbles(raw)
        v = self.views(slot)
        int4pack.pack_nibbles(qs, v["packed"])
        int4pack.scales_zeros(a.scale, a.bias, offset, v["sz"])

    def dequantize(self, slot, scratch):
        v = self.views(slot)
        return int4pack.dequantize_packed(v["packed"], v["sz"], self.group, self.spec.in_features,
                                          scratch[: self.scratch_numel])

    def linear(self, x, slot, scratch):
        if x.shape[0] > INT4_MAX_ROWS and int4pack.layout_known():
            return self._matmul(x, self.dequantize(slot, scratch))
        v = self.views(slot)
        return int4pack.mm(x.to(torch.bfloat16).contiguous(), v["packed"], self.group, v["sz"]).to(self.dtype)


def kernel_for(spec: QuantSpec, dtype: torch.dtype) -> Kernel:
    """The kernel for spec at compute dtype: float32 is always exact (plain / affine); bf16 and f16 use the packed
    int4 op where the format maps onto it (4-bit codes, groups of 32-256, rows a multiple of 16)."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"compute dtype must be float32, bfloat16 or float16, got {dtype}")
    if spec.plain:
        return PlainKernel(spec, dtype)
    if (dtype != torch.float32 and spec.name in _INT4 and spec.out_features % 16 == 0
            and (spec.family != "mlx" or spec.group_size in int4pack.GROUPS)):
        return Int4PackKernel(spec, dtype)
    return AffineKernel(spec, dtype)
