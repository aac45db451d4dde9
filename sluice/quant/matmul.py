"""How several rows of bf16 activations multiply bf16 weights (LoadOptions.matmul, decided per model at load:
Compute.bf16_gemm): torch's bf16 GEMM where the CPU has bf16 dot-product instructions, float32 elsewhere.
rows_linear serves plain weights (resident projections, bf16 experts); the quantized weights' many-row path is
quant/linear.py's. Under bf16 GEMMs, resident bf16 experts keep their weights in oneDNN's blocked layout (pack,
packed_linear) and a prompt's attention runs on bf16 dot products with float32 scores (sdpa)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..host.cpus import bf16_dot
from . import native
from .native import ops

#: LoadOptions.matmul's choices: how several rows of bf16 activations multiply bf16 weights
MATMUL_MODES = ("auto", "bf16", "float32")


def resolve_matmul(mode: str, avx2: bool = False) -> bool:
    """Whether a model multiplies several bf16 rows on torch's bf16 GEMM (Compute.bf16_gemm): "bf16" yes,
    "float32" no (both sides widened, a float32 GEMM), "auto" where the CPU has bf16 dot-product instructions
    (host/cpus.bf16_dot) and `avx2` (LoadOptions.isa capped below AVX-512: as a CPU without them) is False."""
    if mode not in MATMUL_MODES:
        raise ValueError(f"matmul mode {mode!r}: expected one of {', '.join(MATMUL_MODES)}")
    return (bf16_dot() and not avx2) if mode == "auto" else mode == "bf16"


def describe_matmul(mode: str, avx2: bool = False) -> str:
    """What `mode` (LoadOptions.matmul) means on this CPU, for `sluice inspect`."""
    if mode == "auto" and avx2:
        return "float32 GEMM (auto, --isa capped below AVX-512: as a CPU without bf16 dot-product instructions)"
    if mode == "auto":
        return ("bf16 GEMM (auto: this CPU has bf16 dot-product instructions)" if bf16_dot()
                else "float32 GEMM (auto: this CPU has no bf16 dot-product instructions)")
    return f"{mode} GEMM (--matmul {mode})"


def rows_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                bf16: bool = False) -> torch.Tensor:
    """F.linear(x, w, bias) for x [n, in]; several rows of f16, and of bf16 unless `bf16` (the model's
    Compute.bf16_gemm), run in float32 and are cast back.

    Which is faster depends on the CPU, 2 threads: with bf16 dot-product instructions (2-core AMD EPYC, AVX512_BF16)
    torch's bf16 GEMM takes 0.57 ms for [256 x 1024] @ [1024 x 1024] and the float32 route 2.66
    (`.venv/bin/python benchmarks/prefill/knobs.py matmul`); without them (the AVX2 development VM, an earlier
    session's measurement) torch's bf16 GEMM has no native kernel and runs ~6x slower than float32 with both
    conversions ([256 x 1024] @ [1024 x 448] then [256 x 224] @ [224 x 1024]: 27.9 vs 4.5 ms). One row (decode)
    stays in the compute dtype. Both accumulate in float32 and round once at the end, in different orders; resident
    and streamed runs call the same function on the same shapes in one process, so they stay bitwise equal.
    """
    if x.shape[0] > 1 and (x.dtype is torch.float16 or (x.dtype is torch.bfloat16 and not bf16)):
        return F.linear(_widened(x), w.float(), None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, w, bias)


#: rows from which rows_linear widens bf16 x natively over the C pool (the same bits as x.float(): exact); a
#: 2,048-token prompt's router input was one of the 48 [2,048 x 1,024] copies at 1.96 ms each in torch on AVX2
#: (benchmarks/results/quantized/breakdown/prompt-profile-2.txt)
NATIVE_WIDEN_ROWS = 64


def _widened(x: torch.Tensor) -> torch.Tensor:
    if x.dtype is torch.bfloat16 and x.shape[0] >= NATIVE_WIDEN_ROWS and x.is_contiguous() and native.available():
        return ops.to_float32(x)
    return x.float()


# --- resident bf16 weights in oneDNN's blocked layout -------------------------------------------------------------
# F.linear on a plain bf16 weight makes oneDNN copy the weight into its blocked (VNNI) layout on every call; a weight
# packed once skips that copy. 192 experts of [7296 x 256] + [256 x 3648], weights cold in DRAM, 2-core AMD EPYC with
# AVX512_BF16 (`benchmarks/prefill/knobs.py packed`): one row each 63 -> 45 ms, 64 rows 127 -> 106 ms, 256 rows
# 328 -> 304 ms. The packed GEMM runs the same kernels on the same blocks, so it gives F.linear's bits, which is
# checked once per shape before a store packs (packable).
_PACK_ROWS_HINT = 64  # the row count oneDNN picks the blocked layout for; any count runs on it
_PACK_CHECK_ROWS = (1, 3, 17, 64, 200)
_packable: dict[tuple[int, int], bool] = {}


def packable(out_features: int, in_features: int) -> bool:
    """Whether bf16 weights [out, in] may be kept packed (pack) by a model on bf16 GEMMs: torch has oneDNN's
    bf16 ops on this CPU, and a packed random weight gives F.linear's bits for 1 to 200 rows of random input
    (checked once per shape), so a resident store that packs computes bitwise what a streaming store computes with
    F.linear on its slots."""
    if not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight") or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    key = (out_features, in_features)
    if key not in _packable:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(key, generator=g).to(torch.bfloat16)
        try:
            p = pack(w)
            _packable[key] = all(
                torch.equal(F.linear(x, w), _packed(x, p))
                for x in (torch.randn(n, in_features, generator=g).to(torch.bfloat16) for n in _PACK_CHECK_ROWS))
        except RuntimeError:  # an op this build of torch lacks for this shape or CPU
            _packable[key] = False
    return _packable[key]


def pack(w: torch.Tensor) -> torch.Tensor:
    """bf16 w [out, in] in oneDNN's blocked layout (an opaque mkldnn tensor, the same bytes) for packed_linear."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _PACK_ROWS_HINT)


def _packed(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")


def packed_linear(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """rows_linear(x, w, bf16=True) for bf16 x [n, in] and p = pack(w): the same bits (packable), without oneDNN's
    per-call copy of w (only a model on bf16 GEMMs packs)."""
    return _packed(x.contiguous(), p)


# --- a prompt's expert rows in blocks ------------------------------------------------------------------------------
# An expert's rows in a prompt run in blocks whose [rows, 2I] gate / up GEMM output stays within GEMM_BLOCK_BYTES
# (at least GEMM_MIN_BLOCK rows): SwiGLU and the down GEMM then read it from cache, and oneDNN, which builds kernels
# for each row count it has not seen, meets fewer shapes. Demo model at 1 GiB (2I = 7,296: blocks of <= 272 rows),
# resident, 2-core AVX512_BF16 EPYC, `benchmarks/prefill/knobs.py blocks` (fresh process per arm and round, medians
# of 6), 1st / 2nd / 3rd prompt ms: 512 tokens 169 / 142 / 141 in one GEMM, 158 / 135 / 134 in blocks; 2,048 tokens
# 551 / 485 / 483 against 460 / 423 / 424. Narrow experts (the peers model, 2I = 1,024) have little output to keep
# in cache and per-row GEMM cost that still falls past 256 rows: their blocks reach 2,048 rows. On a CPU whose GEMM
# gives a row the same bits whatever the row count (as here) the blocks change no logits; streamed and resident runs
# split alike everywhere.
GEMM_BLOCK_BYTES = 4 << 20
GEMM_MIN_BLOCK = 256


def row_blocks(n: int, width: int, step: int = 16) -> list[tuple[int, int]]:
    """[start, stop) of n bf16 rows whose gate / up GEMM output is `width` wide, in as few blocks as hold at most
    max(GEMM_MIN_BLOCK, GEMM_BLOCK_BYTES / (2 * width)) rows each: whole units of `step` rows dealt out evenly (the
    blocks differ by one unit; the last also loses what n lacks of a whole unit), so no block is a small tail."""
    most = max(GEMM_MIN_BLOCK, GEMM_BLOCK_BYTES // (2 * max(width, 1)) // step * step)
    if n <= most:
        return [(0, n)]
    blocks = -(-n // most)
    units, extra = divmod(-(-n // step), blocks)
    out, a = [], 0
    for k in range(blocks):
        b = min(n, a + (units + (k < extra)) * step)
        out.append((a, b))
        a = b
    return out


# --- a prompt's attention -------------------------------------------------------------------------------------------
def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bf16: bool = False, **kw) -> torch.Tensor:
    """F.scaled_dot_product_attention(q, k, v, **kw) for a prompt's bf16 rows. Under bf16 GEMMs (`bf16`, the model's
    Compute.bf16_gemm) the inputs are
    widened to float32 (exactly) and torch's float32 attention runs with oneDNN's bf16 dot products
    (torch.backends.mkldnn.matmul.fp32_precision = "bf16", set for this call only): products of bf16 inputs are
    exact, sums and softmax stay float32, and the result is rounded once at the end. Against bf16 SDPA, which rounds
    its blocks to bf16 on the way, it is about twice as fast and closer to a float64 reference: 2,048 tokens, 8 query
    / 2 kv heads of 128, causal 53.5 -> 27.6 ms, masked 88.3 -> 48.9 ms, relative error 2.06e-3 -> 1.61e-3
    (`benchmarks/prefill/knobs.py sdpa`). One query row (decode), other dtypes and float32 GEMMs run SDPA as
    given."""
    if q.dtype is not torch.bfloat16 or q.shape[-2] == 1 or not bf16:
        return F.scaled_dot_product_attention(q, k, v, **kw)
    mask = kw.get("attn_mask")
    if mask is not None and mask.dtype is not torch.bool:
        kw["attn_mask"] = mask.float()
    prec = torch.backends.mkldnn.matmul
    old, prec.fp32_precision = prec.fp32_precision, "bf16"
    try:
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw).to(q.dtype)
    finally:
        prec.fp32_precision = old
