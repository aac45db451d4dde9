"""y = x @ W^T from W's stored bytes: one weight's row-count ladder, written once.

    lin = StoredLinear(spec, compute)        # an expert's projection: its bytes come per call (the slot)
    y = lin(x, raw, scratch)                 # x [T, in] -> y [T, out] in the compute dtype
    w = QuantLinear(spec, raw, compute, scratch)  # a resident weight kept in its GGUF blocks (lm_head, attention)
    y = w.linear(x, bias)                    # the same ladder on its own bytes; w.dequantize() the exact weights

The ladder, by the number of rows T (each threshold measured, below):
  - T >= BF16_GEMM_MIN_ROWS of bf16 rows of a resident Q4_K weight where Compute.prompt_planes allows it (int8
    activations on an AVX512-VNNI CPU; any activations where the prompt's GEMMs are float32 and the CPU has AVX2):
    prompt.c's integer tiles;
  - T >= BF16_GEMM_MIN_ROWS of bf16 rows where the model multiplies on bf16 GEMMs (Compute.bf16_gemm): the weights
    dequantized to bf16 (the exact weights rounded once) into the scratch, in blocks of SCRATCH_BYTES, one bf16 GEMM
    per block;
  - T <= Q8_MAX_ROWS at the bf16 / f16 compute dtypes, a GGUF block format: the integer path (native/q8.py: x coded
    to Compute.planes planes of 8-bit codes, integer dots; relative L2 ~3e-5 against the exact weights at two
    planes), its output rows over the C pool;
  - T <= NATIVE_MAX_ROWS: the float row kernel (native/kernels.py: exact weights, float32 dots), rows over the pool;
  - more: blocks of weight rows dequantized exactly into the float32 scratch, one float32 GEMM each (a 151936-row
    head never becomes one 622 MB float32 copy).
Without the native extension the torch path dequantizes the stored bytes (quant/spec.py, bitwise the reference) and
runs one float32 matmul; in float32 every rung is the exact reference computation the tests compare with. The
choices depend on T, the format and the model's Compute only, so a streamed and a resident run compute alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checkpoint.formats import UnsupportedFormat
from ..checkpoint.ref import TensorRef
from . import native
from .compute import Compute
from .native import kernels, prompt, q8
from .spec import QuantSpec

# Rows (tokens of one expert) up to which the native row kernel runs; above it the weights are dequantized natively
# into the float32 scratch (bitwise the reference weights) and torch's float32 matmul runs, whose blocking keeps x
# in cache where the row kernel re-reads it per output row. One [768 x 2048] projection, ms (row kernel /
# dequantize + matmul), one thread, thread CPU time, median of 11 interleaved rounds, dev VM at load ~10
# (benchmarks/results/native_kernels.md):
#   Q4_K  T=16 2.31 / 3.67   T=24 3.15 / 4.08   T=32 3.94 / 4.47   T=48 5.90 / 5.23   T=64 6.33 / 4.87
#   Q8_0  T=16 1.85 / 2.83   T=24 2.73 / 3.27   T=32 3.75 / 3.74   T=48 4.92 / 4.30   T=64 6.43 / 5.56
#   MLX4  T=16 2.36 / 3.37   T=24 2.44 / 3.22   T=32 3.59 / 4.02   T=48 6.01 / 4.63   T=64 7.69 / 6.67
# so the crossover is at 32-48 rows for every format measured (two earlier runs at load 6 and 10 agreed).
NATIVE_MAX_ROWS = 32

# Rows from which a bf16 projection runs as dequantize-to-bf16 + torch's bf16 GEMM where that GEMM is the fast one
# (Compute.bf16_gemm: bf16 dot-product instructions) instead of the float row kernel. ms, row kernel / dequantize to
# bf16 + GEMM, 2 threads, median of 30, 2-core AVX512_BF16 EPYC (`benchmarks/prefill/knobs.py crossover`):
#   Q4_K [1024 x 1024]  T=8 0.13 / 0.19   T=12 0.21 / 0.19   T=16 0.27 / 0.20   T=32 0.52 / 0.27   T=48 0.78 / 0.32
#   Q6_K [1024 x 512]   T=8 0.07 / 0.10   T=12 0.10 / 0.11   T=16 0.13 / 0.12   T=32 0.27 / 0.15   T=48 0.42 / 0.18
BF16_GEMM_MIN_ROWS = 16

# Rows up to which the integer path (q8.linear_q8 / expert_q8) runs at bf16 / f16; above it the float row kernel,
# which dequantizes each weight row once for all rows, wins. One Q4_K / Q6_K / Q4_0 expert [1024 x 512], ms (one
# call on the integer path / three calls of the float row kernel), thread CPU time, best of 3 medians of 50, load ~5:
#   Q4_K  T=1 0.24 / 0.42   T=2 0.36 / 0.56   T=3 0.50 / 0.61   T=4 0.73 / 0.74
#   Q6_K  T=1 0.27 / 0.41   T=2 0.42 / 0.46   T=3 0.60 / 0.61   T=4 0.61 / 0.51
#   Q4_0  T=1 0.18 / 0.24   T=2 0.29 / 0.35   T=3 0.38 / 0.40   T=4 0.55 / 0.50
Q8_MAX_ROWS = 2

#: float32 bytes of weights one block of the many-rows path dequantizes at a time: ~8,000 rows of a 1024-wide head,
#: so the matmul of each block is still large enough for torch's GEMM to run at full speed
SCRATCH_BYTES = 32 * 2**20


def bf16_view(scratch: torch.Tensor, numel: int) -> torch.Tensor:
    """The first `numel` bf16 values of a float32 scratch's memory (>= (numel + 1) // 2 floats): where the bf16 GEMM
    route dequantizes its weights."""
    return scratch[: (numel + 1) // 2].view(torch.bfloat16)[:numel]


class Scratch:
    """One float32 buffer the weights of a model share for their many-rows path (torch.empty, grown on first use:
    pages are committed only when written). A model runs its projections one at a time, so one suffices."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.float32)

    def get(self, numel: int) -> torch.Tensor:
        """A float32 [numel] view of the buffer (its contents are whatever the last user left)."""
        if self._buf.numel() < numel:
            self._buf = None  # freed before its successor is allocated
            self._buf = torch.empty(numel, dtype=torch.float32)
        return self._buf[:numel]

    def get_bf16(self, numel: int) -> torch.Tensor:
        """A bf16 [numel] view of the same buffer."""
        return bf16_view(self.get((numel + 1) // 2), numel)


class StoredLinear:
    """One projection [out, in] stored as `spec`, computing at `compute` (the model's Compute): __call__(x, raw,
    scratch) runs the ladder on bytes handed in per call (an expert's slot). `int_prompt`: a prompt's many bf16 rows
    run prompt.c's integer tiles where Compute.prompt_planes allows it (resident Q4_K weights; an expert's rows take
    prompt.c per expert instead, models/layers/experts.py)."""

    def __init__(self, spec: QuantSpec, compute: Compute, int_prompt: bool = False):
        self.spec, self.compute, self.dtype = spec, compute, compute.dtype
        # the choice is fixed per format, so a streamed and a resident run compute the same way
        self.native = native.available() and native.supports(spec)
        if not self.native and spec.name in native.FORMATS:
            native.warn_unbuilt()
        self.int8 = self.native and compute.dtype is not torch.float32 and q8.q8_supported(spec)
        # a lone Q6_K projection at int16 is no faster on the tiles than on the float32 GEMM ([256 x 512] @ [512 x
        # 1024]: 1.94 vs 1.80 ms; an expert's Q6_K down inside its one call is: 5.20 vs 6.37 ms the expert), Q4_K is
        # (1.71 vs 1.79 at [256 x 1024] @ [1024 x 512], 1.62 vs 2.59 at [256 x 512] @ [512 x 1024]), Q5_K too (1.67
        # vs 1.83); Intel Xeon (Sapphire Rapids VM) capped at AVX2, `knobs.py tiles`
        # (benchmarks/results/prefill/q4km-avx2-default-1GiB: tiles.txt, tiles-q5k.txt)
        formats = compute.prompt_formats if compute.prompt_planes == 1 else compute.prompt_formats & {"Q4_K", "Q5_K"}
        self.prompt_planes = compute.prompt_planes if int_prompt and prompt.supported(spec, formats) else 0

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.spec.out_features, self.spec.in_features))

    def __call__(self, x: torch.Tensor, raw: torch.Tensor, scratch: Scratch, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """y [T, out] = x [T, in] @ W^T (+ bias) in out_dtype (default: the compute dtype); float32 inside, one
        rounding at the end."""
        if raw.numel() != self.spec.nbytes:  # a view longer than the weight (an expert's slot)
            raw = raw[: self.spec.nbytes]
        if not self.native:
            w = self.spec.dequantize(raw, out=scratch.get(self.spec.out_features * self.spec.in_features))
            y = F.linear(x.float(), w.view(self.shape), None if bias is None else bias.float())
            return y.to(out_dtype or self.dtype)
        if (self.prompt_planes and out_dtype in (None, torch.bfloat16) and x.dtype is torch.bfloat16
                and x.shape[0] >= BF16_GEMM_MIN_ROWS):  # 8-bit codes of x, integer dots (native/prompt.c)
            x = x if x.is_contiguous() else x.contiguous()
            y = torch.empty(x.shape[0], self.spec.out_features)  # [T, out] float32
            prompt.linears([(self.spec, raw, y)], x, planes=self.prompt_planes, path=self.compute.path)
            return prompt.to_bf16(y if bias is None else y.add_(bias), path=self.compute.path)
        if out_dtype in (None, torch.bfloat16) and self.compute.gemm_rows(x, BF16_GEMM_MIN_ROWS):
            x = x if x.is_contiguous() else x.contiguous()
            y = self._blocked(x, raw, scratch)
            return y if bias is None else y + bias.to(torch.bfloat16)
        if x.dtype is not torch.float32:
            x = x.float()
        if not x.is_contiguous():
            x = x.contiguous()
        T = x.shape[0]
        if T <= Q8_MAX_ROWS and self.int8:
            return self._q8(x, raw, bias, out_dtype or self.dtype)
        if T <= NATIVE_MAX_ROWS:
            y = kernels.linear(self.spec, x, raw, path=self.compute.path)  # rows over the C pool
        else:
            y = self._blocked(x, raw, scratch)
        if bias is not None:
            y += bias
        out_dtype = out_dtype or self.dtype
        return y if out_dtype is torch.float32 else y.to(out_dtype)

    def _q8(self, x: torch.Tensor, raw: torch.Tensor, bias: torch.Tensor | None,
            out_dtype: torch.dtype) -> torch.Tensor:
        """The integer path on float32 x [T <= Q8_MAX_ROWS, in] (QuantLinear runs it as its prebuilt group)."""
        y = q8.linear_q8(self.spec, x, raw, planes=self.compute.planes, path=self.compute.path)
        if bias is not None:
            y += bias
        return y if out_dtype is torch.float32 else y.to(out_dtype)

    def dequantize_into(self, raw: torch.Tensor, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """The exact weights (rows n0:n1 of them), float32 or rounded to bf16 by out's dtype, into out."""
        n0, n1 = rows if rows is not None else (0, self.spec.out_features)
        if (n0, n1) != (0, self.spec.out_features):
            spec, raw = self._row_block(raw, n0, n1)
        else:
            spec = self.spec
        kernels.dequantize(spec, raw, out, path=self.compute.path)

    def _row_block(self, raw: torch.Tensor, n0: int, n1: int) -> tuple[QuantSpec, torch.Tensor]:
        """(spec, stored bytes) of rows n0:n1: a view of a GGUF weight's rows; an FP8 weight's rows and their block
        scales copied into one buffer (n0 a multiple of the block's rows: ValueError else)."""
        s, k = self.spec, self.spec.in_features
        if s.family == "ggml":
            per_row = s.nbytes // s.out_features  # GGUF: whole blocks per row, no padding
            return QuantSpec.ggml(s.name, n1 - n0, k), raw[n0 * per_row : n1 * per_row]
        if s.family != "fp8" or n0 % s.block_rows:
            raise ValueError(f"rows {n0}:{n1} of {s.family} {s.name}: only GGUF rows and FP8 rows from a block's "
                             "first are dequantized apart")
        spec = QuantSpec.fp8(n1 - n0, k, s.block, s.scale_dtype)
        (w, sc), (w1, sc1) = s.parts, spec.parts
        per_scale_row = sc.nbytes // sc.shape[0]
        r0, r1 = n0 // s.block_rows, -(-n1 // s.block_rows)
        out = torch.empty(spec.nbytes, dtype=torch.uint8)
        out[: w1.nbytes] = raw[w.offset + n0 * k : w.offset + n1 * k]
        out[sc1.offset : sc1.offset + sc1.nbytes] = raw[sc.offset + r0 * per_scale_row : sc.offset + r1 * per_scale_row]
        return spec, out

    def _blocked(self, x: torch.Tensor, raw: torch.Tensor, scratch: Scratch) -> torch.Tensor:
        """Many rows: blocks of weight rows dequantized into the scratch in x's dtype (float32, or bf16 on the bf16
        GEMM route: twice the rows per block), one F.linear per block: x [T, in] -> y [T, out] in x's dtype."""
        n, k = self.shape
        get = scratch.get if x.dtype is torch.float32 else scratch.get_bf16
        # blocks of rows of GGUF formats (whole blocks per row) and of FP8 (whole blocks of rows: a DeepSeek-V3 o_proj
        # [7168, 16384] would be 470 MB at once in float32); an MLX / MXFP4 weight is dequantized whole
        step = max(1, SCRATCH_BYTES // (x.element_size() * k))
        if self.spec.family == "fp8":
            step = max(1, step // self.spec.block_rows) * self.spec.block_rows
        elif self.spec.family != "ggml":
            step = n
        if step >= n:
            w = get(n * k)
            self.dequantize_into(raw, w)
            return F.linear(x, w.view(n, k))
        y = torch.empty(x.shape[0], n, dtype=x.dtype)  # [T, out]
        for n0 in range(0, n, step):
            n1 = min(n, n0 + step)
            w = get((n1 - n0) * k)
            self.dequantize_into(raw, w, (n0, n1))
            y[:, n0:n1] = F.linear(x, w.view(n1 - n0, k))
        return y


class QuantLinear(StoredLinear):
    """A resident projection weight [out, in] kept as its stored GGUF blocks (`raw`, uint8 [spec.nbytes], rows in
    Hugging Face order): lm_head, attention, dense and shared MLPs of a GGUF file; or an FP8 weight with its block
    scales (quant/fp8.py: half the bytes of bf16, and the exact weights through the float row kernel where bf16 would
    round them), which has no integer path: its decode rows take the float row kernel.

    A Q4_K_M file's `output.weight` is Q6_K: 128 MB for a [151936 x 1024] head, 311 MB once converted to bf16, and a
    bf16 F.linear over it took 22.8 ms per decode token on 2 torch threads (this machine has no native bf16 math);
    q8.linear_q8 on the stored bytes takes 23 ms on one thread, ~11.5 split over two. llama.cpp keeps these
    weights quantized too. Measured at commit fafc679 on the peers model's Q4_K_M file (16 layers, hidden 1024, a
    Q6_K head [32768 x 1024]), 2-CPU dev VM, medians: resident weights 210 -> 115 MiB (`sluice inspect`); a
    256-token prefill 5.1 -> 4.2 s, decode 86.4 -> 80.4 ms/token (benchmarks/quantized/resident_ab.py, one process,
    arms alternated, 9 rounds; removed: its command is in benchmarks/results/quantized/README.md); single calls in
    `benchmarks/knobs.py split / head / projections`."""

    def __init__(self, spec: QuantSpec, raw: torch.Tensor, compute: Compute, scratch: Scratch | None = None):
        if not (native.available() and native.supports(spec)) or spec.family not in ("ggml", "fp8"):
            raise ValueError(f"QuantLinear computes GGUF blocks and FP8 weights the native kernels take, not "
                             f"{spec.family} {spec.name}")
        if raw.dtype != torch.uint8 or raw.numel() != spec.nbytes:
            raise ValueError(f"raw must be the {spec.nbytes} stored bytes of {spec.name} [{spec.out_features}, "
                             f"{spec.in_features}], got {raw.numel()} {raw.dtype}")
        super().__init__(spec, compute, int_prompt=True)
        self.raw = raw.contiguous()
        self.scratch = scratch if scratch is not None else Scratch()
        self.planes = compute.planes
        # decode's integer call, checked once (rows over the C pool); FP8 weights take the float row kernel instead
        self._group = QuantGroup([self]) if self.int8 else None

    @property
    def nbytes(self) -> int:
        """Bytes held: the stored blocks."""
        return self.raw.numel()

    def __repr__(self) -> str:
        return f"QuantLinear({self.spec.name}, shape={list(self.shape)}, dtype={self.dtype})"

    def dequantize(self, rows: tuple[int, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The exact float32 weights [out, in] (bitwise the file's dequantization), or rows n0:n1 of them [n1 - n0,
        in]; into out (float32, contiguous) when given, or those weights rounded to bf16 into a bf16 out."""
        n0, n1 = rows if rows is not None else (0, self.spec.out_features)
        if out is None:
            out = torch.empty(n1 - n0, self.spec.in_features)
        self.dequantize_into(self.raw, out, rows)
        return out.view(n1 - n0, self.spec.in_features)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """y [T, out] = x [T, in] @ W^T (+ bias), in out_dtype (default: the compute dtype): the ladder above."""
        return self(x, self.raw, self.scratch, bias, out_dtype)

    def _q8(self, x: torch.Tensor, raw: torch.Tensor, bias: torch.Tensor | None,
            out_dtype: torch.dtype) -> torch.Tensor:
        return self._group.linear(x, (bias,), out_dtype)[0]

    @staticmethod
    def group(ws: "list[QuantLinear]") -> "QuantGroup | None":
        """One native call computing several QuantLinears of one x (a layer's q, k and v) on the integer path, x
        quantized once, or None when they cannot share one (other in_features or computes, or a format without an
        integer path: FP8)."""
        if (len({w.spec.in_features for w in ws}) != 1 or len({w.compute for w in ws}) != 1
                or not all(w.int8 for w in ws)):
            return None
        return QuantGroup(ws)


class QuantGroup:
    """QuantLinears of one x (same in_features and Compute) on the integer path in one native call (q8.LinearsQ8):
    `linear(x, biases)` finishes each output as QuantLinear.linear does (float32, plus its bias, one rounding to
    out_dtype; bias-free bf16 outputs rounded in the C call, the same bits). A QuantLinear's own decode call is a
    group of one."""

    def __init__(self, ws: "list[QuantLinear]"):
        self.compute = ws[0].compute
        self.dtype = self.compute.dtype
        self._q8 = q8.LinearsQ8([(w.spec, w.raw) for w in ws])
        # a prompt's rows of all of them in one prompt.linears call (x coded once) where each takes the tiles
        self._ws = ws if len(ws) <= 4 and all(w.prompt_planes for w in ws) else None

    def prompt_rows(self, x: torch.Tensor, biases) -> list[torch.Tensor] | None:
        """[y_a [T, out_a]] (the compute dtype) for a prompt's rows x [T, in] in one prompt.linears call, bitwise
        what each QuantLinear.linear gives on them (the same codes of x, the same tiles); None where the rows do not
        take the tiles (too few, not bf16, or a member's format)."""
        if self._ws is None or x.dtype is not torch.bfloat16 or x.shape[0] < BF16_GEMM_MIN_ROWS:
            return None
        x = x if x.is_contiguous() else x.contiguous()
        outs = torch.empty(x.shape[0], sum(w.spec.out_features for w in self._ws))  # [T, sum out] float32
        ys = list(outs.split([w.spec.out_features for w in self._ws], dim=1))
        prompt.linears([(w.spec, w.raw, y) for w, y in zip(self._ws, ys)], x, planes=self._ws[0].prompt_planes,
                       path=self.compute.path)
        return [prompt.to_bf16(y if b is None else y.add_(b), path=self.compute.path) for y, b in zip(ys, biases)]

    def linear(self, x: torch.Tensor, biases, out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """[y_a [T, out_a]] for x [T, in] (T <= Q8_MAX_ROWS) and one bias (or None) per projection."""
        if x.dtype is not torch.float32:
            x = x.float()
        if not x.is_contiguous():
            x = x.contiguous()
        out_dtype = out_dtype or self.dtype
        c = self.compute
        if out_dtype is torch.bfloat16 and all(b is None for b in biases):
            return self._q8(x, c.planes, out_dtype=out_dtype, path=c.path)
        ys = self._q8(x, c.planes, path=c.path)
        for y, b in zip(ys, biases):
            if b is not None:
                y += b
        return ys if out_dtype is torch.float32 else [y.to(out_dtype) for y in ys]


def quant_spec(ref: TensorRef, dtype: torch.dtype) -> QuantSpec | None:
    """The QuantSpec a resident 2-D tensor keeps as a QuantLinear at compute dtype `dtype`, or None when it is
    converted to `dtype` as before: float32 (the exact reference), plain or MLX tensors, GGUF formats without an
    integer path, or no native extension. An FP8 weight is kept with its block scales. The one rule the load
    (models/weights.py) and the memory plan (plan.py) share."""
    if dtype not in (torch.bfloat16, torch.float16) or not native.available():
        return None
    if ref.fp8 is not None and len(ref.shape) == 2 and not ref.values:
        try:
            return QuantSpec.fp8(*ref.shape, ref.fp8.block, ref.fp8.scale.torch_dtype)
        except ValueError:
            return None  # read_tensor dequantizes it
    if not ref.quantized or ref.mlx is not None or ref.values or len(ref.shape) != 2:
        return None  # (values a converter mapped are undone on the dequantized tensor: read_tensor)
    try:
        spec = QuantSpec.ggml(ref.dtype, *ref.shape)
    except (UnsupportedFormat, ValueError):
        return None  # read_tensor raises the CheckpointError naming the tensor
    if not q8.q8_supported(spec) or spec.nbytes != ref.nbytes:
        return None
    return spec
