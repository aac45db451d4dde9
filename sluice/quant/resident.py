"""Resident projections kept in their stored GGUF blocks (lm_head, attention, dense and shared MLPs).

A Q4_K_M file's `output.weight` is Q6_K: 128 MB for a [151936 x 1024] head, 311 MB once converted to bf16, and a
bf16 F.linear over it took 22.8 ms per decode token on 2 torch threads (this machine has no native bf16 math);
`native.linear_q8` on the stored bytes takes 23 ms on one thread, ~11.5 split over two. llama.cpp keeps these
weights quantized too. `QuantLinear` holds the stored bytes as read from the file and computes from them:

    w = QuantLinear(spec, raw, torch.bfloat16, scratch)   # spec: QuantSpec.ggml of a format native.q8_supported
    w.shape, w.nbytes, w.dequantize()                     # [out, in]; stored bytes; exact float32 weights
    y = w.linear(x, bias)                                 # x [T, in] -> [T, out] in the compute dtype

Rows (T) up to native.kernel.Q8_MAX_ROWS run the integer path (x quantized once, integer dots; relative L2 ~3e-5
against the exact weights), up to NATIVE_MAX_ROWS the float row kernel, more rows (prefill) dequantize blocks of
weight rows into the shared float32 scratch (SCRATCH_BYTES) and run float32 F.linear on each: a 151936-row head never
becomes one 622 MB float32 copy. The integer path splits every weight's output rows over the extension's threads
(native.LinearsQ8, pool.c: a handoff costs a few us there); the float row kernel splits those of the large weights
(SPLIT_MIN_WEIGHTS: the head) over native.shared_pool()'s Python threads. Any split gives the same bits.
`quant_spec` is the one rule deciding which tensors stay quantized, so the load (store/weights.py) and the memory
plan (plan.py) cannot disagree.

Measured at commit fafc679 on the peers model's Q4_K_M file (benchmarks/models/qwen3_moe-peers: 16 layers, hidden
1024, a Q6_K head [32768 x 1024]), 2-CPU dev VM, medians. Resident weights 210 -> 115 MiB (`sluice inspect`). Single
calls (`benchmarks/knobs.py projections`): bf16 F.linear of [33 x 1024] x [1024 x 1024]^T 3.7-4.1 ms, this
blocked float32 path 1.3-1.6; the head at T=1 5.2-5.4 ms bf16 on 2 torch threads, 5.1-5.3 here on one thread, 3.1
split over native.set_threads(2); attention at T=1 about even (q [1024 x 1024] 0.12-0.13 bf16 / 0.11-0.15 here; k,
v [256 x 1024] 0.03-0.04 / 0.04-0.07). So decode ms/token did not move beyond the VM's +-15% run-to-run noise, and a
256-token prefill got faster (benchmarks/quantized/resident_ab.py, removed: its command is in
benchmarks/results/quantized/README.md; one process, arms alternated, 9 rounds, bf16 / QuantLinear / with
set_threads(2): decode 86.4 / 80.4 / 80.7 ms/token, prefill 5.1 / 4.2 / 4.3 s). The head of a 151936-token
vocabulary, Q6_K at T=1 (`benchmarks/knobs.py head`): bf16 24.2 ms, one thread 19-23, split over Pool(2) 11-12 (21
when torch's OpenMP workers still spin from a parallel op).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checkpoint.ref import TensorRef
from ..matmul import bf16_gemm
from . import native
from .formats import UnsupportedFormat
from .kernels import QuantSpec
from .native import prompt
from .native.kernel import BF16_GEMM_MIN_ROWS, NATIVE_MAX_ROWS, Q8_MAX_ROWS, bf16_view

#: float32 bytes of weights one block of the many-rows path dequantizes at a time: ~8,000 rows of a 1024-wide head,
#: so the matmul of each block is still large enough for torch's GEMM to run at full speed
SCRATCH_BYTES = 32 * 2**20

#: weights (out x in) from which the float row kernel (T up to NATIVE_MAX_ROWS) splits the output rows over
#: native.shared_pool(): a handoff to a Python pool thread costs ~0.1 ms here. Measured on the integer path before it
#: moved to the C pool: Q4_K at T=1, ms on one thread / split over Pool(2), median of 101, quiet 2-CPU
#: VM (`benchmarks/knobs.py split` and `projections`): [1024 x 1024] 0.15 / 0.25, [2048 x 1024] 0.20 /
#: 0.27, [4096 x 1024] 0.38 / 0.46, [8192 x 1024] 0.87 / 0.78; the peers model's Q6_K head [32768 x 1024] 5.3 / 3.1
#: (bf16 F.linear on 2 torch threads: 5.2)
SPLIT_MIN_WEIGHTS = 2**24


class Scratch:
    """One float32 buffer the QuantLinears of a model share for their many-rows path (torch.empty, grown on first
    use: pages are committed only when written). The model runs its projections one at a time, so one suffices."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.float32)

    def get(self, numel: int) -> torch.Tensor:
        """A float32 [numel] view of the buffer (its contents are whatever the last user left)."""
        if self._buf.numel() < numel:
            self._buf = torch.empty(numel, dtype=torch.float32)
        return self._buf[:numel]

    def get_bf16(self, numel: int) -> torch.Tensor:
        """A bf16 [numel] view of the same buffer."""
        return bf16_view(self.get((numel + 1) // 2), numel)


class QuantLinear:
    """A resident projection weight [out, in] kept as its stored GGUF blocks (`raw`, uint8 [spec.nbytes], rows in
    Hugging Face order), computing at `dtype` (bfloat16 / float16)."""

    def __init__(self, spec: QuantSpec, raw: torch.Tensor, dtype: torch.dtype, scratch: Scratch | None = None,
                 planes: int | None = None):
        """`planes`: the integer path's activation planes (2: x to ~1/32,000 of a block's max; 1: llama.cpp's
        1/127), None: native.Q8_PLANES when called."""
        if not native.q8_supported(spec):
            raise ValueError(f"QuantLinear computes the formats native.q8_supported takes, not {spec.name}")
        if raw.dtype != torch.uint8 or raw.numel() != spec.nbytes:
            raise ValueError(f"raw must be the {spec.nbytes} stored bytes of {spec.name} [{spec.out_features}, "
                             f"{spec.in_features}], got {raw.numel()} {raw.dtype}")
        self.spec, self.raw, self.dtype, self.planes = spec, raw.contiguous(), dtype, planes
        # a prompt's many bf16 rows on 8-bit codes (prompt.c) where activations are int8 and the CPU runs it fast
        self._int8_prompt = prompt.wanted(dtype, planes) and prompt.supported(spec)
        self.scratch = scratch if scratch is not None else Scratch()
        self._q8 = QuantGroup([self])  # decode's call, checked once; rows over the C pool
        self._split = spec.out_features * spec.in_features >= SPLIT_MIN_WEIGHTS

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.spec.out_features, self.spec.in_features))

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
        per_row = self.spec.nbytes // self.spec.out_features  # one part of whole blocks per row: no padding
        spec = QuantSpec.ggml(self.spec.name, n1 - n0, self.spec.in_features)
        return native.dequantize(spec, self.raw[n0 * per_row : n1 * per_row], out)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """y [T, out] = x [T, in] @ W^T (+ bias), in out_dtype (default: the compute dtype); float32 inside, one
        rounding at the end; where torch's bf16 GEMM is the fast one (matmul.bf16_gemm), many bf16 rows to a bf16
        output run on the weights rounded to bf16 (_blocked on bf16 x)."""
        if (x.shape[0] >= BF16_GEMM_MIN_ROWS and x.dtype is torch.bfloat16 and self.dtype is torch.bfloat16
                and out_dtype in (None, torch.bfloat16) and bf16_gemm()):
            if self._int8_prompt:  # activations int8: 8-bit codes of x, integer dots (native/prompt.c)
                y = torch.empty(x.shape[0], self.spec.out_features)  # [T, out] float32
                prompt.linears([(self.spec, self.raw, y)], x if x.is_contiguous() else x.contiguous())
                return (y if bias is None else y.add_(bias)).to(torch.bfloat16)
            y = self._blocked(x if x.is_contiguous() else x.contiguous())
            return y if bias is None else y + bias.to(torch.bfloat16)
        if x.dtype is not torch.float32:
            x = x.float()
        if not x.is_contiguous():
            x = x.contiguous()
        T = x.shape[0]
        if T <= Q8_MAX_ROWS:
            return self._q8.linear(x, (bias,), out_dtype)[0]
        pool = native.shared_pool() if self._split else None
        out_dtype = out_dtype or self.dtype
        if T <= NATIVE_MAX_ROWS:
            y = native.linear(self.spec, x, self.raw) if pool is None else pool.linear(self.spec, x, self.raw)
        else:
            y = self._blocked(x)
        if bias is not None:
            y += bias
        return y if out_dtype is torch.float32 else y.to(out_dtype)

    @staticmethod
    def group(ws: "list[QuantLinear]") -> "QuantGroup | None":
        """One native call computing several QuantLinears of one x (a layer's q, k and v) on the integer path, x
        quantized once, or None when they cannot share one (other in_features, compute dtypes or planes)."""
        if len({w.spec.in_features for w in ws}) != 1 or len({(w.dtype, w.planes) for w in ws}) != 1:
            return None
        return QuantGroup(ws)

    def _blocked(self, x: torch.Tensor) -> torch.Tensor:
        """Many rows: blocks of weight rows dequantized into the scratch in x's dtype (float32, or bf16 on the bf16
        GEMM route: twice the rows per block), one F.linear per block: x [T, in] -> y [T, out] in x's dtype."""
        n, k = self.shape
        get = self.scratch.get if x.dtype is torch.float32 else self.scratch.get_bf16
        step = max(1, SCRATCH_BYTES // (x.element_size() * k))
        if step >= n:
            return F.linear(x, self.dequantize(out=get(n * k)))
        y = torch.empty(x.shape[0], n, dtype=x.dtype)  # [T, out]
        for n0 in range(0, n, step):
            n1 = min(n, n0 + step)
            y[:, n0:n1] = F.linear(x, self.dequantize((n0, n1), get((n1 - n0) * k)))
        return y


class QuantGroup:
    """QuantLinears of one x (same in_features and compute dtype) on the integer path in one native call
    (native.LinearsQ8): `linear(x, biases)` finishes each output as QuantLinear.linear does (float32, plus its bias,
    one rounding to out_dtype; bias-free bf16 outputs rounded in the C call, the same bits). A QuantLinear's own
    decode call is a group of one."""

    def __init__(self, ws: "list[QuantLinear]"):
        self.dtype, self.planes = ws[0].dtype, ws[0].planes
        self._q8 = native.LinearsQ8([(w.spec, w.raw) for w in ws])

    def linear(self, x: torch.Tensor, biases, out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """[y_a [T, out_a]] for x [T, in] (T <= Q8_MAX_ROWS) and one bias (or None) per projection."""
        if x.dtype is not torch.float32:
            x = x.float()
        if not x.is_contiguous():
            x = x.contiguous()
        out_dtype = out_dtype or self.dtype
        if out_dtype is torch.bfloat16 and all(b is None for b in biases):
            return self._q8(x, self.planes, out_dtype=out_dtype)
        ys = self._q8(x, self.planes)
        for y, b in zip(ys, biases):
            if b is not None:
                y += b
        return ys if out_dtype is torch.float32 else [y.to(out_dtype) for y in ys]


def quant_spec(ref: TensorRef, dtype: torch.dtype) -> QuantSpec | None:
    """The QuantSpec a resident 2-D tensor keeps as a QuantLinear at compute dtype `dtype`, or None when it is
    converted to `dtype` as before: float32 (the exact reference), plain or MLX tensors, formats without an integer
    path, or no native extension."""
    if dtype not in (torch.bfloat16, torch.float16) or not native.native_available():
        return None
    if not ref.quantized or ref.mlx is not None or len(ref.shape) != 2:
        return None
    try:
        spec = QuantSpec.ggml(ref.dtype, *ref.shape)
    except (UnsupportedFormat, ValueError):
        return None  # read_tensor raises the CheckpointError naming the tensor
    if not native.q8_supported(spec) or spec.nbytes != ref.nbytes:
        return None
    return spec
