"""The routed experts' math from slot bytes: SwiGLU y = down(act(gate x) * up x) for one expert.

`ExpertMath(compute, act, glu)[fmt]` is the math of one stored format (store/layout.py): `GluMath` for the gate /
up / down experts of every architecture but gpt-oss, `BiasedGluMath` for gpt-oss's biased, interleaved ones. Each is
built once per format and owns its ladder (by rows: one native call, prompt.c's 8-bit kernel, bf16 GEMMs on
dequantized weights, the projections' own ladders: quant/linear.py), so the MoE block never tests a format's type.

Plain experts (BF16/F16/F32) run F.linear on typed views of the slots, gate and up as one [2I, H] matrix; quantized
experts run each projection from its stored bytes, with one float32 scratch reused by every call. The same function
serves the resident and the streaming store, so a streamed run computes bitwise what a resident run computes on the
same slots.

Experts that run as one native call each (below) split their rows over the extension's threads (pool.c), and at
decode a layer's experts go to it together (layers/moe.py Experts._native); every other kind runs on one thread with
torch's own threads inside the matmuls. A Python pool over experts was measured and dropped once, when each expert
still cost ~0.1 ms of Python around the C call and torch's OpenMP workers spun between the bf16 ops around it
(peers Q4_K_M resident: 118 ms/token with the pool, 69.6 without; benchmarks/quantized/expert_threads.py,
removed: its command is in benchmarks/results/quantized/README.md).

At the bf16 / f16 compute dtypes, a SwiGLU expert whose three projections have integer kernels (every GGUF block
type: quant/native/q8.c, and q8_low.c for MXFP4 and the 1-3 bit types, mixed as a file mixes them) runs as one native call up to EXPERT_Q8_MAX_ROWS rows (q8.expert_q8: x quantized
once for gate and up, silu(g) * u in float32, down), instead of three kernel calls and the casts between them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...checkpoint.ref import DTYPES
from ...quant import native
from ...quant.compute import Compute
from ...quant.linear import BF16_GEMM_MIN_ROWS, Scratch, StoredLinear
from ...quant.matmul import packed_linear, row_blocks, rows_linear
from ...quant.native import kernels, prompt, q8
from ...store.layout import BiasedGluFormat, ExpertFormat

# Rows up to which a quantized expert runs as one q8.expert_q8 call at bf16 / f16; above it, three kernel calls
# (the float row kernel dequantizes each weight row once for all rows). ms per expert, three float-kernel calls /
# one expert_q8 call, bf16 x, thread CPU time, median of 41 interleaved rounds, load ~4.6
# (T=1: benchmarks/results/native_kernels.md, "Integer path"):
#   1024x512 Q4_K  T=2 0.69/0.39  T=3 0.74/0.50  T=4 0.88/0.71  T=6 1.08/1.11  T=8 1.35/1.46
#   1024x512 Q6_K  T=2 0.64/0.45  T=3 0.70/0.62  T=4 0.95/0.92  T=6 1.29/1.37  T=8 1.54/1.74
#   2048x768 Q4_K  T=2 1.53/0.95  T=3 1.21/0.94  T=4 1.69/1.32  T=6 2.02/1.95  T=8 2.58/2.56
#   2048x768 Q6_K  T=2 1.16/0.90  T=3 1.35/1.24  T=4 2.25/1.84  T=6 2.52/2.43  T=8 3.37/3.31
EXPERT_Q8_MAX_ROWS = 4

# A prompt's experts with BF16_GEMM_MIN_ROWS or more rows run bf16 GEMMs on their rows padded to a multiple of this
# (zero rows, results dropped; on a CPU whose GEMM gives a row the same bits whatever the row count, as here, the
# logits are unchanged: tests/store/test_prefill.py; streamed and resident runs pad alike everywhere). oneDNN
# builds kernels for each row count it has not seen, and every prompt brings new ones. Demo model at 1 GiB, resident,
# three prompts in a fresh process, medians of 3 alternated processes (`benchmarks/prefill/knobs.py rows`): 512
# tokens 208 / 180 / 179 ms padded vs 236 / 214 / 201 unpadded; 2,048 tokens 650 / 565 / 544 vs 693 / 641 / 614.
GEMM_ROW_STEP = 16

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
    plain act(gate) * up, which GluMath may also compute inside one native call per expert."""
    if spec.swiglu_limit is not None:
        return clamped_swiglu(spec.swiglu_alpha, spec.swiglu_limit)
    return None


class ExpertMath:
    """The experts' math for every storage format a model's layout holds, at its Compute: `self[fmt]` is the format's
    math object (built once), all of them sharing one float32 scratch."""

    def __init__(self, compute: Compute, act: Callable[[torch.Tensor], torch.Tensor], glu: Glu | None = None):
        """`glu`: (gate, up) -> hidden; default act(gate) * up (glu_for builds the Spec's)."""
        self.compute, self.act = compute, act
        self.glu = glu or (lambda gate, up: act(gate) * up)  # the Qwen / Mixtral / OLMoE SwiGLU
        self.plain_glu = glu is None  # the one-call native expert computes act(gate) * up only
        self.scratch = Scratch()
        self._by_format: dict[object, GluMath | BiasedGluMath] = {}

    def __getitem__(self, fmt: ExpertFormat | BiasedGluFormat) -> "GluMath | BiasedGluMath":
        math = self._by_format.get(fmt)
        if math is None:
            kind = BiasedGluMath if isinstance(fmt, BiasedGluFormat) else GluMath  # the one place formats differ
            math = self._by_format[fmt] = kind(fmt, self)
        return math


class GluMath:
    """One ExpertFormat's experts: down(glu(gate x, up x))."""

    def __init__(self, fmt: ExpertFormat, owner: ExpertMath):
        c = owner.compute
        self.fmt, self.compute, self.glu, self.scratch = fmt, c, owner.glu, owner.scratch
        self.rows_linear = lambda x, w: rows_linear(x, w, bf16=c.bf16_gemm)  # noqa: E731
        specs = (fmt.gate_up, fmt.gate, fmt.up, fmt.down)
        self.gate_up, self.gate, self.up, self.down = (None if s is None else StoredLinear(s, c) for s in specs)
        one = (c.dtype is not torch.float32 and owner.act is F.silu and owner.plain_glu and native.available()
               and all(q8.q8_supported(s) for s in fmt.specs))
        self.call = q8.ExpertCall(fmt.specs, (0, fmt.up_offset, fmt.down_offset)) if one else None
        # the planes of 8-bit activation codes at which a prompt's rows (more than EXPERT_Q8_MAX_ROWS) run prompt.c's
        # integer tiles, 0 for none: Compute.prompt_planes (activations "int8" on a CPU with AVX512-VNNI; any
        # activations on AVX2 where the prompt's GEMMs are float32), gate and up of a format the tiles take there
        # (Compute.prompt_formats). Such rows need no padding for a GEMM (layers/moe.py)
        ok = all(prompt.supported(s, c.prompt_formats) for s in (fmt.gate_up or fmt.gate, fmt.up))
        self.prompt_planes = c.prompt_planes if ok else 0
        self.down_tiles = ok and prompt.supported(fmt.down, c.prompt_formats)  # Q4_K; Q6_K on the AVX2 tiles
        self.int8_rows = self.prompt_planes > 0
        # ... and as one native call each (prompt.expert), so a layer codes its rows once for all experts (coded())
        self.int8_whole = self.int8_rows and owner.act is F.silu and owner.plain_glu
        # ... and a pass's experts already in memory in one call (coded_many), where the down takes the tiles too
        self.experts_call = (prompt.ExpertsCall(fmt.gate_up or fmt.gate, None if fmt.gate_up else fmt.up, fmt.down,
                                                (0, fmt.up_offset, fmt.down_offset))
                             if self.int8_whole and self.down_tiles else None)

    def one_call(self, rows: int) -> bool:
        """Whether an expert on `rows` rows runs as one native call (q8.expert_q8): no shared scratch, no torch op,
        the GIL released, so a layer's experts may run on several threads at once (into())."""
        return rows <= EXPERT_Q8_MAX_ROWS and self.call is not None

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
            return self._swiglu(x, gu, dn, self.rows_linear)
        fmt, raw, c = self.fmt, batch.raw[slot], self.compute
        if self.one_call(x.shape[0]):
            y = torch.empty(x.shape, dtype=torch.float32)  # [n, H]
            self.call(raw, x.float().contiguous(), y, c.planes, path=c.path)
            return y.to(c.dtype)
        if x.shape[0] > EXPERT_Q8_MAX_ROWS and self.int8_rows:
            return self._int8_rows(raw, x)
        if len(row_blocks(x.shape[0], 2 * fmt.gate.out_features)) > 1 and self._gemm_rows(x):
            # several row blocks: the weights dequantized to bf16 once for all of them. One block keeps the calls
            # below (each projection dequantized just before its GEMM, into the same scratch), which took less time
            # than the three at once in a cProfile comparison on the peers Q4_K_M model (not kept)
            return self._swiglu(x, *self._bf16_weights(raw), self.rows_linear)
        if self.gate_up is not None:  # one call over the 2I rows of [gate; up]
            g, u = self.gate_up(x, raw[: fmt.up_offset + fmt.up.nbytes], self.scratch).chunk(2, dim=-1)  # [n, I]
        else:
            g = self.gate(x, raw[: fmt.gate.nbytes], self.scratch)  # [n, I]
            u = self.up(x, raw[fmt.up_offset : fmt.up_offset + fmt.up.nbytes], self.scratch)  # [n, I]
        return self.down(self.glu(g, u), raw[fmt.down_offset : fmt.down_offset + fmt.down.nbytes], self.scratch)

    def into(self, batch, j: int, x: torch.Tensor, out: torch.Tensor) -> None:
        """The j-th expert of `batch` on x float32 [n, H] into out float32 [n, H], for a format one_call accepts
        (the float32 result __call__ casts to the compute dtype)."""
        self.call(batch.raw[batch.slots[j]], x, out, self.compute.planes, path=self.compute.path)

    def many(self, batch, js: list[int], x: torch.Tensor, ys: torch.Tensor, extra: tuple | None = None) -> None:
        """Experts js of `batch` on the same x float32 [1, H] into rows js of ys float32 [n, H] in one native call,
        their rows split over the native threads (q8.ExpertCall.many): row j bitwise what into() writes. `extra`:
        (q8.expert_args of a shared expert, its row of ys), computed in the same call, bitwise what extra_into()
        writes."""
        self.call.many(batch.raw, [batch.slots[j] for j in js], x, ys, js, self.compute.planes,
                       path=self.compute.path, extra=extra)

    def extra_into(self, args: tuple, x: torch.Tensor, out: torch.Tensor) -> None:
        """A shared expert (q8.expert_args of this format's H and I) on x float32 [1, H] into out float32 [1, H]:
        one expert_q8 call, as into() runs a routed one."""
        q8.run_expert_args(args, self.call.h, self.call.i, x, out, self.compute.planes, path=self.compute.path)

    def coded(self, batch, j: int, x: "prompt.Coded", rows: torch.Tensor, out: torch.Tensor) -> None:
        """The j-th expert of `batch` on rows `rows` (int64 [n]) of a layer's coded rows x (prompt.code), for a
        format int8_whole takes, into out [n, H] (contiguous, the compute dtype): bitwise what __call__ gives on
        those rows of the uncoded x. A Q4_K / Q6_K down writes out in the native call itself (a fresh [n, H] result
        copied into the layer's block, its pages faulted in each time: a 2,048-token AVX2 prompt of the peers model
        spent 196 ms in copy_, 1,265 calls, now 71 in 273; torch's profiler,
        benchmarks/results/quantized/breakdown/prompt-profile.txt)."""
        self._int8_call(batch.raw[batch.slots[j]], x, rows.numel(), rows, out)

    def coded_many(self, batch, js: list[int], x: "prompt.Coded", rows: torch.Tensor, starts: list[int],
                   counts: list[int], out: torch.Tensor) -> None:
        """Experts js of `batch` (waited for) in one native call (experts_call not None): expert js[e] on rows
        rows[starts[e] : + counts[e]] of x into out's same rows, each bitwise what coded() writes."""
        self.experts_call.run(batch.raw, [batch.slots[j] for j in js], x, rows, starts, counts, out,
                              path=self.compute.path)

    def _int8_rows(self, raw: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """down(glu(gate x, up x)) on a prompt's rows x [n, H] with 8-bit activations (prompt.c): gate and up from
        one coding of x, the product in float32, coded again for a Q4_K down; any other down format takes its
        StoredLinear on the product rounded to the compute dtype."""
        fmt, path, p = self.fmt, self.compute.path, self.prompt_planes
        n, i = x.shape[0], fmt.gate.out_features
        x = x.contiguous()
        if self.int8_whole:  # one native call
            return self._int8_call(raw, x, n)
        dn = raw[fmt.down_offset : fmt.down_offset + fmt.down.nbytes]
        gu = torch.empty(n, 2 * i)  # [n, 2I] float32
        if fmt.gate_up is not None:
            prompt.linears([(fmt.gate_up, raw[: fmt.up_offset + fmt.up.nbytes], gu)], x, planes=p, path=path)
        else:
            prompt.linears([(fmt.gate, raw[: fmt.gate.nbytes], gu[:, :i]),
                            (fmt.up, raw[fmt.up_offset : fmt.up_offset + fmt.up.nbytes], gu[:, i:])], x, planes=p,
                           path=path)
        h = self.glu(*gu.chunk(2, dim=-1)).contiguous()  # [n, I] float32
        if self.down_tiles:
            y = torch.empty(n, fmt.down.out_features)  # [n, H]
            prompt.linears([(fmt.down, dn, y)], h, planes=p, path=path)
            return y.to(self.compute.dtype)
        return self.down(h.to(self.compute.dtype), dn, self.scratch)

    def _int8_call(self, raw: torch.Tensor, x, n: int, rows: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """prompt.expert on x [n, H] bf16, or on rows of a prompt.Coded x: [n, H] bf16 (out, when given)."""
        fmt, path = self.fmt, self.compute.path
        i = fmt.gate.out_features
        dn = raw[fmt.down_offset : fmt.down_offset + fmt.down.nbytes]
        gate = (fmt.gate_up, raw[: fmt.up_offset + fmt.up.nbytes]) if fmt.gate_up is not None else \
            (fmt.gate, raw[: fmt.gate.nbytes])
        up = None if fmt.gate_up is not None else (fmt.up, raw[fmt.up_offset : fmt.up_offset + fmt.up.nbytes])
        if self.down_tiles:
            y = torch.empty(n, fmt.down.out_features, dtype=torch.bfloat16) if out is None else out  # [n, H]
            prompt.expert(gate, up, (fmt.down, dn), x, y, rows=rows, planes=self.prompt_planes, path=path)
            return y
        # [n, I]: silu(g) * u for the down's own kernel, a bf16 GEMM: its rows padded with zero rows as a layer
        # pads a GEMM's (GEMM_ROW_STEP: oneDNN builds kernels per row count)
        pad = -(-n // GEMM_ROW_STEP) * GEMM_ROW_STEP if n >= BF16_GEMM_MIN_ROWS and self.compute.bf16_gemm else n
        h = torch.empty(pad, i, dtype=torch.bfloat16)
        h[n:] = 0
        prompt.expert(gate, up, None, x, h[:n], rows=rows, planes=self.prompt_planes, path=path)
        y = self.down(h, dn, self.scratch)[:n]
        if out is not None:
            out.copy_(y)
        return y

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

    def _gemm_rows(self, x: torch.Tensor) -> bool:
        """Whether x's rows take the bf16 GEMM route of every projection (StoredLinear's condition)."""
        ks = (self.gate, self.up, self.down)
        return self.compute.gemm_rows(x, BF16_GEMM_MIN_ROWS) and all(k.native for k in ks)

    def _bf16_weights(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]): an expert's stored weights dequantized to bf16 (each value the exact
        weight rounded to nearest, as StoredLinear's bf16 route has them) in the scratch's memory, for a prompt's
        rows: dequantized once however many row blocks run on them, gate and up one [2I, H] GEMM operand. The scratch
        holds them within the runtime's share of the budget (RUNTIME_RESERVE: 9 MiB at I = 768, H = 2048)."""
        fmt, path = self.fmt, self.compute.path
        (i, h), d = (fmt.gate.out_features, fmt.gate.in_features), fmt.down_offset
        w = self.scratch.get_bf16(3 * i * h)
        gu, dn = w[: 2 * i * h].view(2 * i, h), w[2 * i * h :].view(h, i)
        if fmt.gate_up is not None:  # [gate; up] as one stored tensor: one call
            kernels.dequantize(fmt.gate_up, raw[: fmt.up_offset + fmt.up.nbytes], gu, path=path)
        else:
            kernels.dequantize(fmt.gate, raw[: fmt.gate.nbytes], gu[:i], path=path)
            kernels.dequantize(fmt.up, raw[fmt.up_offset : fmt.up_offset + fmt.up.nbytes], gu[i:], path=path)
        kernels.dequantize(fmt.down, raw[d : d + fmt.down.nbytes], dn, path=path)
        return gu, dn


class BiasedGluMath:
    """gpt-oss's experts (BiasedGluFormat): y = down(glu(gate, up)) + b_down, gate and up the rows of
    gate_up(x) + b_gate_up (alternating, or its two halves in a GGUF's order); the clamped SwiGLU, projection by
    projection (no one-call or 8-bit prompt path)."""

    int8_rows = int8_whole = False
    prompt_planes, down_tiles = 0, False

    def __init__(self, fmt: BiasedGluFormat, owner: ExpertMath):
        c = owner.compute
        self.fmt, self.compute, self.glu, self.scratch = fmt, c, owner.glu, owner.scratch
        self.rows_linear = lambda x, w: rows_linear(x, w, bf16=c.bf16_gemm)  # noqa: E731
        self.gate_up, self.down = (StoredLinear(s, c) for s in fmt.specs)

    def one_call(self, rows: int) -> bool:
        return False

    def _glu(self, gu: torch.Tensor) -> torch.Tensor:
        """glu(gate, up) of gate_up's output gu [n, 2I]: gate 0, up 0, gate 1, ... or (halves) gate rows, up rows."""
        if self.fmt.halves:
            return self.glu(*gu.chunk(2, dim=-1))
        return self.glu(gu[:, 0::2], gu[:, 1::2])

    def __call__(self, batch, j: int, x: torch.Tensor) -> torch.Tensor:
        fmt, raw = self.fmt, batch.raw[batch.slots[j]]
        gu_bias = fmt.gate_up_bias.view(raw).to(x.dtype)  # [2I]
        dn_bias = fmt.down_bias.view(raw).to(x.dtype)  # [H]
        dn_raw = raw[fmt.down_offset : fmt.down_offset + fmt.down.nbytes]
        if fmt.transposed:  # plain, stored [in, out]: x @ W through F.linear on the transposed view
            gu_w = fmt.gate_up.parts[0].view(raw).view(DTYPES[fmt.gate_up.name][1])  # [H, 2I]
            dn_w = fmt.down.parts[0].view(dn_raw).view(DTYPES[fmt.down.name][1])  # [I, H]
            gu = self.rows_linear(x, gu_w.to(x.dtype).t()) + gu_bias  # [n, 2I]
            return self.rows_linear(self._glu(gu), dn_w.to(x.dtype).t()) + dn_bias
        gu = self.gate_up(x, raw[: fmt.gate_up.nbytes], self.scratch) + gu_bias  # [n, 2I]
        return self.down(self._glu(gu), dn_raw, self.scratch) + dn_bias
