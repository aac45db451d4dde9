"""The routed experts' math from slot bytes: SwiGLU y = down(act(gate x) * up x) for one expert.

Plain experts (BF16/F16/F32) run F.linear on typed views of the slots, gate and up as one [2I, H] matrix; quantized
experts run each projection from its stored bytes (quant/stored.py), with one float32 scratch reused by every call.
The same function serves the resident and the streaming store, so a streamed run computes bitwise what a resident
run computes on the same slots.

Experts that run as one native call each (below) split their rows over the extension's threads (pool.c), and at
decode a layer's experts go to it together (Transformer._native_experts); every other kind runs on one thread with
torch's own threads inside the matmuls. A Python pool over experts was measured and dropped once, when each expert
still cost ~0.1 ms of Python around the C call and torch's OpenMP workers spun between the bf16 ops around it
(peers Q4_K_M resident: 118 ms/token with the pool, 69.6 without); see engine.py for the C pool (its numbers came
from benchmarks/quantized/expert_threads.py, removed: its command is in benchmarks/results/quantized/README.md).

At the bf16 / f16 compute dtypes, a SwiGLU expert whose three projections have integer kernels (GGUF block
formats, quant/native/q8.c) runs as one native call up to EXPERT_Q8_MAX_ROWS rows (native.expert_q8: x quantized
once for gate and up, silu(g) * u in float32, down), instead of three kernel calls and the casts between them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..checkpoint.ref import DTYPES
from ..matmul import packed_linear, row_blocks, rows_linear
from ..quant import native
from ..quant.native import prompt
from ..quant.native.kernel import BF16_GEMM_MIN_ROWS, bf16_gemm_rows, bf16_view
from ..quant.stored import StoredLinear
from ..store.layout import BiasedGluFormat


# Rows up to which a quantized expert runs as one native.expert_q8 call at bf16 / f16; above it, three kernel calls
# (the float row kernel dequantizes each weight row once for all rows). ms per expert, three NativeKernel calls on
# the float row kernel / one expert_q8 call, bf16 x, thread CPU time, median of 41 interleaved rounds, load ~4.6
# (T=1: benchmarks/results/native_kernels.md, "Integer path"):
#   1024x512 Q4_K  T=2 0.69/0.39  T=3 0.74/0.50  T=4 0.88/0.71  T=6 1.08/1.11  T=8 1.35/1.46
#   1024x512 Q6_K  T=2 0.64/0.45  T=3 0.70/0.62  T=4 0.95/0.92  T=6 1.29/1.37  T=8 1.54/1.74
#   2048x768 Q4_K  T=2 1.53/0.95  T=3 1.21/0.94  T=4 1.69/1.32  T=6 2.02/1.95  T=8 2.58/2.56
#   2048x768 Q6_K  T=2 1.16/0.90  T=3 1.35/1.24  T=4 2.25/1.84  T=6 2.52/2.43  T=8 3.37/3.31
EXPERT_Q8_MAX_ROWS = 4


Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def clamped_swiglu(alpha: float, limit: float) -> Glu:
    """gpt-oss's expert activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = gate clamped
    above at limit (transformers' GptOssExperts._apply_gate)."""

    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    return glu


def glu_for(spec, act: Callable[[torch.Tensor], torch.Tensor]) -> Glu | None:
    """(gate, up) -> the experts' hidden activation for a Spec: the clamped form (swiglu_limit), or None for the
    plain act(gate) * up, which ExpertMath may also compute inside one native call per expert."""
    if spec.swiglu_limit is not None:
        return clamped_swiglu(spec.swiglu_alpha, spec.swiglu_limit)
    return None


class ExpertMath:
    """Expert forward passes for every storage format the layout holds, at one compute dtype."""

    def __init__(self, dtype: torch.dtype, act: Callable[[torch.Tensor], torch.Tensor], glu: Glu | None = None,
                 planes: int | None = None):
        """`glu`: (gate, up) -> hidden; default act(gate) * up (glu_for builds the Spec's). `planes`: the integer
        path's activation planes (LoadOptions.activations; None: native.Q8_PLANES when called)."""
        self.dtype, self.act, self.planes = dtype, act, planes
        self.glu = glu or (lambda gate, up: act(gate) * up)  # the Qwen / Mixtral / OLMoE SwiGLU
        self._plain_glu = glu is None  # the one-call native expert computes act(gate) * up only
        self._kernels: dict[object, tuple] = {}
        self._fused: dict[object, native.ExpertCall | None] = {}  # format -> its one-call path, or None
        self._int8: dict[object, bool] = {}  # format -> whether a prompt's rows take prompt.c (int8_rows)
        self._scratch_numel = 0  # the largest projection of any format seen
        self._scratch_buf = torch.empty(0, dtype=torch.float32)

    def __call__(self, batch, j: int, x: torch.Tensor) -> torch.Tensor:
        """The j-th expert of `batch` (store/base.py ExpertBatch) on x [n, H] -> [n, H]."""
        slot = batch.slots[j]
        if batch.packed is not None:  # the resident store's bf16 experts: F.linear's bits (matmul.packable)
            return self._swiglu(x, batch.packed[0][slot], batch.packed[1][slot], packed_linear)
        if batch.gate_up is not None:
            gu = batch.gate_up[slot]  # [2I, H]
            dn = batch.down[slot]  # [H, I]
            if gu.dtype != x.dtype:  # streamed slots keep the checkpoint dtype
                gu, dn = gu.to(x.dtype), dn.to(x.dtype)
            return self._swiglu(x, gu, dn, rows_linear)
        fmt, raw = batch.format, batch.raw[slot]
        if isinstance(fmt, BiasedGluFormat):
            return self._biased(fmt, raw, x)
        if self.one_call(fmt, x.shape[0]):
            y = torch.empty(x.shape, dtype=torch.float32)  # [n, H]
            self._fused[fmt](raw, x.float().contiguous(), y, self.planes)
            return y.to(self.dtype)
        if x.shape[0] > EXPERT_Q8_MAX_ROWS and self.int8_rows(fmt):
            return self._int8_rows(fmt, raw, x)
        gate_up, gate, up, down = self._kernels_for(fmt)
        scratch = self._scratch()
        if len(row_blocks(x.shape[0], 2 * fmt.gate.out_features)) > 1 and self._gemm_rows(x, (gate, up, down)):
            # several row blocks: the weights dequantized to bf16 once for all of them. One block keeps the calls
            # below (each projection dequantized just before its GEMM, into the same scratch), which took less time
            # than the three at once in a cProfile comparison on the peers Q4_K_M model (not kept)
            return self._swiglu(x, *self._bf16_weights(fmt, raw, scratch), rows_linear)
        if gate_up is not None:  # one call over the 2I rows of [gate; up]
            g, u = gate_up(x, raw[: fmt.up_offset + fmt.up.nbytes], scratch).chunk(2, dim=-1)  # [n, I] each
        else:
            g = gate(x, raw[: fmt.gate.nbytes], scratch)  # [n, I]
            u = up(x, raw[fmt.up_offset : fmt.up_offset + fmt.up.nbytes], scratch)  # [n, I]
        return down(self.glu(g, u), raw[fmt.down_offset : fmt.down_offset + fmt.down.nbytes], scratch)

    def int8_rows(self, fmt) -> bool:
        """Whether a prompt's rows (more than EXPERT_Q8_MAX_ROWS) of this format's experts run prompt.c's int8
        kernel: activations "int8" (one plane, llama.cpp's coding) at the bf16 compute dtype, plain SwiGLU-shaped
        experts with Q4_K gate and up, on a CPU with AVX512-VNNI (elsewhere the bf16 GEMM on dequantized weights is
        faster than its portable path). Such rows need no padding for a GEMM (Transformer.experts)."""
        ok = self._int8.get(fmt)
        if ok is None:
            ok = self._int8[fmt] = bool(
                prompt.wanted(self.dtype, self.planes) and not isinstance(fmt, BiasedGluFormat)
                and all(prompt.supported(s) for s in (fmt.gate_up or fmt.gate, fmt.up)))
        return ok

    def _int8_rows(self, fmt, raw: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """down(glu(gate x, up x)) on a prompt's rows x [n, H] with 8-bit activations (prompt.c): gate and up from
        one coding of x, the product in float32, coded again for a Q4_K down; any other down format takes its
        StoredLinear on the product rounded to the compute dtype."""
        n, i = x.shape[0], fmt.gate.out_features
        x = x.contiguous()
        if self.int8_whole(fmt):  # one native call
            return self._int8_call(fmt, raw, x, n)
        dn = raw[fmt.down_offset : fmt.down_offset + fmt.down.nbytes]
        gu = torch.empty(n, 2 * i)  # [n, 2I] float32
        if fmt.gate_up is not None:
            prompt.linears([(fmt.gate_up, raw[: fmt.up_offset + fmt.up.nbytes], gu)], x)
        else:
            prompt.linears([(fmt.gate, raw[: fmt.gate.nbytes], gu[:, :i]),
                            (fmt.up, raw[fmt.up_offset : fmt.up_offset + fmt.up.nbytes], gu[:, i:])], x)
        h = self.glu(*gu.chunk(2, dim=-1)).contiguous()  # [n, I] float32
        if prompt.supported(fmt.down):
            y = torch.empty(n, fmt.down.out_features)  # [n, H]
            prompt.linears([(fmt.down, dn, y)], h)
            return y.to(self.dtype)
        down = self._kernels_for(fmt)[3]
        return down(h.to(self.dtype), dn, self._scratch())

    def int8_whole(self, fmt) -> bool:
        """Whether a prompt's rows of this format's experts run as one native call each (prompt.expert): int8_rows
        and the plain SiLU GLU; Transformer.experts then codes a layer's rows once for all its experts (coded())."""
        return self.int8_rows(fmt) and self.act is F.silu and self._plain_glu

    def coded(self, batch, j: int, x: "prompt.Coded", rows: torch.Tensor) -> torch.Tensor:
        """The j-th expert of `batch` on rows `rows` (int64 [n]) of a layer's coded rows x (prompt.code), for a
        format int8_whole takes: bitwise what __call__ gives on those rows of the uncoded x."""
        return self._int8_call(batch.format, batch.raw[batch.slots[j]], x, rows.numel(), rows)

    def _int8_call(self, fmt, raw: torch.Tensor, x, n: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """prompt.expert on x [n, H] bf16, or on rows of a prompt.Coded x: [n, H] bf16."""
        i = fmt.gate.out_features
        dn = raw[fmt.down_offset : fmt.down_offset + fmt.down.nbytes]
        gate = (fmt.gate_up, raw[: fmt.up_offset + fmt.up.nbytes]) if fmt.gate_up is not None else \
            (fmt.gate, raw[: fmt.gate.nbytes])
        up = None if fmt.gate_up is not None else (fmt.up, raw[fmt.up_offset : fmt.up_offset + fmt.up.nbytes])
        if prompt.supported(fmt.down):
            y = torch.empty(n, fmt.down.out_features, dtype=torch.bfloat16)  # [n, H]
            prompt.expert(gate, up, (fmt.down, dn), x, y, rows=rows)
            return y
        # [n, I]: silu(g) * u for the down's own kernel, a bf16 GEMM: its rows padded with zero rows as
        # Transformer.experts pads a GEMM's (blocks.GEMM_ROW_STEP: oneDNN builds kernels per row count)
        from .blocks import GEMM_ROW_STEP
        pad = -(-n // GEMM_ROW_STEP) * GEMM_ROW_STEP if n >= BF16_GEMM_MIN_ROWS else n
        h = torch.empty(pad, i, dtype=torch.bfloat16)
        h[n:] = 0
        prompt.expert(gate, up, None, x, h[:n], rows=rows)
        return self._kernels_for(fmt)[3](h, dn, self._scratch())[:n]

    def _swiglu(self, x: torch.Tensor, gu: torch.Tensor, dn: torch.Tensor, lin) -> torch.Tensor:
        """down(glu(gate x, up x)) of bf16 / float weights gu [2I, H] and dn [H, I] (plain, or packed for
        lin = packed_linear) on x [n, H] -> [n, H], in matmul.row_blocks of x's rows."""
        blocks = row_blocks(x.shape[0], gu.shape[0])
        if len(blocks) == 1:
            return lin(self.glu(*lin(x, gu).chunk(2, dim=-1)), dn)
        out = torch.empty_like(x)
        for a, b in blocks:
            out[a:b] = lin(self.glu(*lin(x[a:b], gu).chunk(2, dim=-1)), dn)
        return out

    def one_call(self, fmt, rows: int) -> bool:
        """Whether an expert of `fmt` on `rows` rows runs as one native call (native.expert_q8): no shared scratch,
        no torch op, the GIL released, so a layer's experts may run on several threads at once (into())."""
        return rows <= EXPERT_Q8_MAX_ROWS and self._one_call(fmt) is not None

    def _one_call(self, fmt) -> "native.ExpertCall | None":
        call = self._fused.get(fmt, ())
        if call == ():
            specs = self._fused_specs(fmt)
            call = self._fused[fmt] = None if specs is None else native.ExpertCall(
                specs, (0, fmt.up_offset, fmt.down_offset))
        return call

    def into(self, batch, j: int, x: torch.Tensor, out: torch.Tensor) -> None:
        """The j-th expert of `batch` on x float32 [n, H] into out float32 [n, H], for a format one_call accepts
        (the float32 result __call__ casts to the compute dtype)."""
        self._fused[batch.format](batch.raw[batch.slots[j]], x, out, self.planes)

    def many(self, batch, js: list[int], x: torch.Tensor, ys: torch.Tensor) -> None:
        """Experts js of `batch` on the same x float32 [1, H] into rows js of ys float32 [n, H] in one native call,
        their rows split over the native threads (native.ExpertCall.many): row j bitwise what into() writes."""
        self._fused[batch.format].many(batch.raw, [batch.slots[j] for j in js], x, ys, js, self.planes)

    def _biased(self, fmt: BiasedGluFormat, raw: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """gpt-oss: y = down(glu(gate, up)) + b_down, [gate, up] interleaved in gate_up(x) + b_gate_up."""
        gu_bias = fmt.gate_up_bias.view(raw).to(x.dtype)  # [2I]
        dn_bias = fmt.down_bias.view(raw).to(x.dtype)  # [H]
        dn_raw = raw[fmt.down_offset : fmt.down_offset + fmt.down.nbytes]
        if fmt.transposed:  # plain, stored [in, out]: x @ W through F.linear on the transposed view
            gu_w = fmt.gate_up.parts[0].view(raw).view(DTYPES[fmt.gate_up.name][1])  # [H, 2I]
            dn_w = fmt.down.parts[0].view(dn_raw).view(DTYPES[fmt.down.name][1])  # [I, H]
            gu = rows_linear(x, gu_w.to(x.dtype).t()) + gu_bias  # [n, 2I]
            return rows_linear(self.glu(gu[:, 0::2], gu[:, 1::2]), dn_w.to(x.dtype).t()) + dn_bias
        gate_up, down = self._kernels_for(fmt)
        scratch = self._scratch()
        gu = gate_up(x, raw[: fmt.gate_up.nbytes], scratch) + gu_bias  # [n, 2I]: columns gate 0, up 0, gate 1, ...
        return down(self.glu(gu[:, 0::2], gu[:, 1::2]), dn_raw, scratch) + dn_bias

    def _gemm_rows(self, x: torch.Tensor, kernels: tuple) -> bool:
        """Whether x's rows take the bf16 GEMM route of every projection (NativeKernel._bf16_gemm's condition)."""
        return bf16_gemm_rows(x, self.dtype) and all(k.native is not None for k in kernels)

    def _bf16_weights(self, fmt, raw: torch.Tensor, scratch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]): an expert's stored weights dequantized to bf16 (each value the exact
        weight rounded to nearest, as NativeKernel._bf16_gemm has them) in the scratch's memory, for a prompt's
        rows: dequantized once however many row blocks run on them, gate and up one [2I, H] GEMM operand."""
        (i, h), d = (fmt.gate.out_features, fmt.gate.in_features), fmt.down_offset
        w = bf16_view(scratch, 3 * i * h)
        gu, dn = w[: 2 * i * h].view(2 * i, h), w[2 * i * h :].view(h, i)
        if fmt.gate_up is not None:  # [gate; up] as one stored tensor: one call
            native.dequantize(fmt.gate_up, raw[: fmt.up_offset + fmt.up.nbytes], gu)
        else:
            native.dequantize(fmt.gate, raw[: fmt.gate.nbytes], gu[:i])
            native.dequantize(fmt.up, raw[fmt.up_offset : fmt.up_offset + fmt.up.nbytes], gu[i:])
        native.dequantize(fmt.down, raw[d : d + fmt.down.nbytes], dn)
        return gu, dn

    def _scratch(self) -> torch.Tensor:
        """The float32 scratch the torch paths and the native many-rows path write weights into (torch.empty: pages
        are committed only where a call writes, so the native row kernels' unused scratch costs nothing)."""
        if self._scratch_buf.numel() < self._scratch_numel:
            self._scratch_buf = torch.empty(self._scratch_numel, dtype=torch.float32)
        return self._scratch_buf

    def _fused_specs(self, fmt) -> tuple | None:
        """(gate, up, down) specs when this format's experts run as one native call at this dtype, else None
        (float32 keeps the exact float kernels; other activations and formats run projection by projection)."""
        if isinstance(fmt, BiasedGluFormat):  # gpt-oss: biases and the clamped SwiGLU, projection by projection
            return None
        specs = (fmt.gate, fmt.up, fmt.down)
        ok = (self.dtype is not torch.float32 and self.act is F.silu and self._plain_glu
              and native.native_available() and all(native.q8_supported(s) for s in specs))
        return specs if ok else None

    def _kernels_for(self, fmt) -> tuple:
        """(gate_up or None, gate, up, down) StoredLinears of one ExpertFormat, (gate_up, down) of a
        BiasedGluFormat; built once."""
        k = self._kernels.get(fmt)
        if k is None:
            specs = fmt.specs if isinstance(fmt, BiasedGluFormat) else (fmt.gate_up, fmt.gate, fmt.up, fmt.down)
            k = self._kernels[fmt] = tuple(None if s is None else StoredLinear(s, self.dtype, self.planes)
                                           for s in specs)
            # sized once per format: the scratch grows to it at the next expert
            self._scratch_numel = max(self._scratch_numel, *(x.scratch_numel for x in k if x is not None))
            # room for the three as bf16 (_bf16_weights): 6 I H bytes, touched only where a prompt's expert rows
            # take several blocks (4 I H before; like it, in the runtime's share of the budget, RUNTIME_RESERVE:
            # 9 MiB at I = 768, H = 2048)
            if not isinstance(fmt, BiasedGluFormat):
                i, h = fmt.gate.out_features, fmt.gate.in_features
                self._scratch_numel = max(self._scratch_numel, (3 * i * h + 1) // 2)
        return k
