"""What a model's layers are built from (`Build`) and what one forward pass hands them (`Step`).

An architecture file composes its layers from the modules of this folder (`layers(b: Build) -> [Layer]`); each
module takes what it needs from `b` when it is built and makes its kernel choices there, once: the forward pass runs
what was chosen and changes no process-wide state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...quant import native
from ...quant.compute import Compute
from ...quant.linear import QuantLinear
from ...quant.native import delta_prompt, deltanet
from ...quant.native.decode import DecodeAttention
from ..rope import rope_table
from ..spec import KVCache, LayerWeights, Spec, Weights
from .experts import ExpertMath, glu_for
from .norm import Norm

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu,
                                                                  "sigmoid": torch.sigmoid}


@dataclass(frozen=True)
class Kernels:
    """Where a model has two implementations of the same step, which it builds (all True: the fastest this machine
    has; tests and benchmarks build the other to compare them). Each is a choice made at build, never in a pass.

    native_decode           a bf16 decode step's attention core (norms, rope, cache writes, attention) and softmax
                            router as one native call each (native/decode.py), where every projection and expert
                            runs natively anyway; False: the torch steps
    native_prompt_attention a prompt's causal attention in one native call (native/attend.py), where Compute allows
    split_experts           decode's experts of one layer in one native call with their rows over the C pool;
                            False: one call per expert
    code_rows_once          activations int8: a layer's prompt rows coded once and gathered by each expert; False: each
                            expert codes its own rows (the same bits)
    native_deltanet         a Gated DeltaNet layer's decode token (conv, delta rule, gated norm) in one native call
                            (native/deltanet.py), where the model computes in float32 or bf16; False: the torch steps
    native_delta_prompt     a Gated DeltaNet layer's delta rule over a prompt in one native call
                            (native/delta_prompt.py), where the model computes in float32 or bf16; False: the torch
                            steps (delta_rule.chunked)
    """

    native_decode: bool = True
    native_prompt_attention: bool = True
    split_experts: bool = True
    code_rows_once: bool = True
    native_deltanet: bool = True
    native_delta_prompt: bool = True


class Step:
    """One forward pass of T tokens at positions pos..pos+T-1: what every layer reads (the masks, one per sliding
    window, built on first use; the token ids, for blocks that look them up: PLE) and what the residual rule hands
    the MoE block (`prompt_guess`, the next MoE layer's likely experts for a prompt's read-ahead, set by
    `after_mixer`)."""

    def __init__(self, pos: int, T: int, after_mixer: Callable[[int, torch.Tensor, "Step"], None] | None = None,
                 tokens: torch.Tensor | None = None):
        self.pos, self.T, self.tokens = pos, T, tokens  # tokens [T] int64
        self.after_mixer = after_mixer
        self.prompt_guess: tuple[int, list[int]] | None = None
        self._masks: dict[int | None, torch.Tensor | None] = {}

    def drop_masks(self) -> None:
        """Let the masks go (a pass run layer by layer beside others builds them again at its next layer)."""
        self._masks.clear()

    def mask(self, window: int | None) -> torch.Tensor | None:
        """Boolean attention mask [T, pos+T] (True = attend) for this pass's queries; None when all may attend."""
        if window not in self._masks:
            self._masks[window] = causal_mask(self.pos, self.T, window)
        return self._masks[window]


def causal_mask(pos: int, T: int, window: int | None) -> torch.Tensor | None:
    """Boolean attention mask [T, pos+T] (True = attend) for queries at pos..pos+T-1; None when all may attend."""
    if T == 1 and (window is None or pos < window):
        return None
    q = torch.arange(pos, pos + T)[:, None]
    kv = torch.arange(pos + T)[None, :]
    allowed = kv <= q
    if window is not None:
        allowed &= kv > q - window
    return allowed


class Workspace:
    """The [n, H] block a prompt's MoE layers gather their expert-sorted rows into: the same memory for every layer
    of a forward pass (the model drops it after the pass). Allocated per layer it was 32 MiB at 2,048 tokens of a
    top-8 H=1024 bf16 model, at or above glibc's largest mmap threshold: a fresh mapping each layer, 8,192 page faults
    to fill it (peers bf16, resident 2,048-token prefill: 230k -> ~90k minor faults; benchmarks/prefill/faults.py,
    removed: its command is in benchmarks/results/prefill/README.md)."""

    def __init__(self) -> None:
        self._block: torch.Tensor | None = None

    def rows(self, n: int, x: torch.Tensor, capacity: int = 0) -> torch.Tensor:
        """A [n, H] block of x's dtype; `capacity`: rows to allocate when it grows (room for the padding any layer
        may bring)."""
        H = x.shape[1]
        if self._block is None or self._block.dtype != x.dtype or self._block.numel() < n * H:
            self._block = None  # freed before its successor is allocated
            self._block = torch.empty(max(n, capacity) * H, dtype=x.dtype)
        return self._block[: n * H].view(n, H)

    def release(self) -> None:
        self._block = None


def _projections(lw: LayerWeights) -> list:
    """A layer's mixer projections: q, k, v, o, or a Gated DeltaNet's input projections and o."""
    if lw.delta is None:
        return [lw.q, lw.k, lw.v, lw.o]
    d = lw.delta
    return [lw.o] + [p for p in (d.qkv, d.z, d.b, d.a, d.qkvz, d.ba) if p is not None]


class Build:
    """Everything a layer module is built from: the blueprint, resident weights, expert store, caches, the model's
    Compute and Kernels, and what its layers share (the rope tables, the experts' math, the prompt workspace, the
    decode attention's scratch). Model-wide choices are made here, once. `tables`: layer -> the row table
    (store/rows.py RowTable) of its PLE block's n-gram embeddings (Spec.ple)."""

    def __init__(self, spec: Spec, weights: Weights, store, cache: KVCache, compute: Compute,
                 kernels: Kernels = Kernels(), rows=None, prerouter=None, prompt_prerouter=None, tables=None):
        self.spec, self.w, self.store, self.cache, self.compute, self.kernels = (
            spec, weights, store, cache, compute, kernels)
        self.rows, self.prerouter, self.prompt_prerouter = rows, prerouter, prompt_prerouter
        self.tables = tables or {}
        self.dtype = compute.dtype
        self.act = ACTIVATIONS[spec.hidden_act]
        self.expert_math = ExpertMath(compute, self.act, glu_for(spec, self.act))
        self.cos, self.sin = rope_table(spec.rope, cache.max_context, self.dtype)  # [P, rot] each
        self.workspace = Workspace()
        self.integer_decode = self._integer_decode()
        self.native_decode = self._native_decode()
        self.decode_attention = (DecodeAttention(spec.n_heads, spec.n_kv_heads, spec.head_dim, self.cos, self.sin,
                                                 path=compute.path) if self.native_decode else None)
        self.native_deltanet = self._native_deltanet()
        d = spec.delta
        self.deltanet_decode = (deltanet.DeltaNetDecode(d.n_k_heads, d.n_v_heads, d.k_head_dim, d.v_head_dim,
                                                        d.conv_kernel, self.dtype, tiled=d.tiled, path=compute.path)
                                if self.native_deltanet else None)
        self.delta_prompt = (delta_prompt.DeltaRulePrompt(d.n_k_heads, d.n_v_heads, d.k_head_dim, d.v_head_dim,
                                                          self.dtype, tiled=d.tiled, path=compute.path)
                             if self._native_delta_prompt() else None)

    def norm(self, weight: torch.Tensor, group: int | None = None) -> Norm:
        """The RMSNorm of `weight` as this architecture scales it (plain or zero-centred, Spec.zero_centred_norms),
        per `group` values of a row when given (hyper-connections' streams)."""
        return Norm.of(self.spec, weight, self.compute.path, group)

    def _integer_decode(self) -> bool:
        """Whether a decode step's projections and experts all run natively from their quantized blocks (every
        projection a QuantLinear, every MoE layer's experts one native call): the integer kernels there already
        give a position other bits than the prefill's float kernels do, so its attention and router may run
        natively too (native_decode). A plain model keeps the torch steps, so its decode numerics stay what they
        were (tests/server/test_server.py's seeded repeats run on one)."""
        layout = getattr(self.store, "layout", None)
        projections = [self.w.lm_head] + [p for lw in self.w.layers for p in _projections(lw)]
        return (layout is not None and all(lw.mla is None for lw in self.w.layers)
                and all(type(w) is QuantLinear for w in projections)
                and all(self.expert_math[layout.format(L)].one_call(1) for L in layout.layers))

    def _native_decode(self) -> bool:
        """Whether each layer's attention of one bf16 decode token runs natively (native/decode.py: the q / k norms,
        rope, cache writes and attention of a layer in one call instead of ~25 torch ops; the softmax router's
        probabilities go with it): the extension, bf16, no latent attention, an integer decode step, bf16 tables and
        caches. Its output matches SDPA's to within bf16 rounding, not bitwise (decode.c says how); streamed and
        resident runs share it."""
        s, caches = self.spec, [lc.k for lc in self.cache.layers if lc.k is not None]
        bf16 = lambda t: t is None or (t.dtype is torch.bfloat16 and t.is_contiguous())  # noqa: E731
        return (self.kernels.native_decode and native.available() and self.dtype is torch.bfloat16
                and s.mla is None and self.integer_decode and bf16(self.cos) and bool(caches)
                and all(bf16(k) for k in caches)
                and all(bf16(lw.router) and bf16(lw.q_norm) and bf16(lw.k_norm) for lw in self.w.layers))

    def _native_deltanet(self) -> bool:
        """Whether each Gated DeltaNet layer runs a decode token natively (native/deltanet.py: the conv's step, the
        delta rule on the float32 state and the gated norm in one call instead of ~40 torch ops): the extension, such
        layers, a dtype it computes in (float32, bf16) and the layers' weights and caches in it. Its output is the
        torch steps' to float32 rounding (bf16: within a rounding where torch rounds), not bitwise (deltanet.c says
        how); streamed and resident runs share it."""
        d, x, f32 = self.spec.delta, self.dtype, torch.float32
        if not (self.kernels.native_deltanet and native.available() and d is not None and x in deltanet.DTYPES):
            return False
        fits = lambda t, dtype: t.dtype is dtype and t.is_contiguous()  # noqa: E731
        ws = [lw.delta for lw in self.w.layers if lw.delta is not None]
        caches = [c for c in self.cache.layers if c.recurrent is not None]
        return (all(fits(w.conv, x) and fits(w.norm, x) and fits(w.A_log, f32) and fits(w.dt_bias, f32) for w in ws)
                and all(fits(c.conv, x) and fits(c.recurrent, f32) for c in caches))

    def _native_delta_prompt(self) -> bool:
        """Whether each Gated DeltaNet layer runs a prompt's delta rule natively (native/delta_prompt.py: the chunked
        rule in one call): the extension, such layers, a dtype it computes in (float32, bf16) and float32 states.
        At Qwen3.5's shapes (16 key / 32 value heads of 128, tiled, bf16, 2,048 tokens in slices of 256, 2 threads)
        37 ms a layer against chunked's 151 (AVX-512; the AVX2 kernel 53), float32 outputs 8.7e-7 from a float64
        run against chunked's 1.2e-6 (benchmarks/results/hybrid/delta_rule_timing.py, delta_rule_timing_native.txt).
        Its output is chunked's to float32 rounding, not bitwise (delta_prompt.c says how); streamed and resident
        runs share it."""
        d, x = self.spec.delta, self.dtype
        return (self.kernels.native_delta_prompt and native.available() and d is not None and x in deltanet.DTYPES
                and all(c.recurrent.dtype is torch.float32 and c.recurrent.is_contiguous()
                        for c in self.cache.layers if c.recurrent is not None))
