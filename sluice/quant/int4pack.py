"""torch's packed int4 CPU matmul (`aten._weight_int4pack_mm_for_cpu`) fed from 4-bit formats.

The op computes y = x @ W^T for x [T, K] (bf16 here) and W [N, K] given as
- packed codes uint8 [N, K/2]: the layout `aten._convert_weight_to_int4pack_for_cpu` writes from int32 codes 0-15,
  which depends on the CPU kernel torch dispatches to (rows in blocks of BLOCK_N = 32 on AVX2, 64 on AVX512, nibble
  pairs chosen for its unpacking; see `_layout`);
- scales_and_zeros [K/group, N, 2] in x's dtype, group 32/64/128/256: value = (code - 8) * scale + zero.

A 4-bit Affine (value = scale * c + bias, c = code or code - 8) maps onto it exactly in float32 terms with
scale = scale and zero = bias + (8 - offset) * scale; the op then holds scale and zero in bf16 (8 bits of mantissa),
which is the whole of its error against the exact dequantization (see kernels.py for measured numbers).

`pack_codes` writes the layout with a few strided torch ops straight into a preallocated buffer (no int32 copy of
the codes, no allocation of the output); it is checked once per process against the op itself, and the op is used
instead (with its allocations) on a CPU whose layout this file does not know.
"""

from __future__ import annotations

import functools

import torch

from .affine import Affine

GROUPS = (32, 64, 128, 256)  # the group sizes the op accepts


@functools.cache
def _layout() -> str:
    """'avx512' / 'avx2' / 'pairs' (the kernel's BLOCK_N and nibble pairing), or 'op' when our packer disagrees with
    the op on this machine (then pack_codes calls the op)."""
    cap = torch.backends.cpu.get_cpu_capability()
    guess = "avx512" if cap.startswith("AVX512") else "avx2" if cap == "AVX2" else "pairs"
    g = torch.Generator().manual_seed(0)
    n, k = 2 * _block_n(guess) + 16, 64  # two full blocks and a tail
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    got = torch.empty(n, k // 2, dtype=torch.uint8)
    _pack(codes, got, guess)
    return guess if torch.equal(got, want) else "op"


def layout_known() -> bool:
    """Whether sluice can write (and read back) the op's packed layout on this CPU."""
    return _layout() != "op"


def _block_n(layout: str) -> int:
    return 64 if layout == "avx512" else 32


def pack_codes(codes: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 codes 0-15 [N, K] (N a multiple of 16, K even) -> the op's packed uint8 [N, K/2], into `out` if given."""
    n, k = codes.shape
    if n % 16 or k % 2:
        raise ValueError(f"int4 packing needs rows a multiple of 16 and an even row length, got {n} x {k}")
    if out is None:
        out = torch.empty(n, k // 2, dtype=torch.uint8)
    layout = _layout()
    if layout == "op":  # TODO: a layout we have not seen; the op allocates an int32 copy and its output
        out.copy_(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
    else:
        _pack(codes, out, layout)
    return out


def _pack(codes: torch.Tensor, out: torch.Tensor, layout: str) -> None:
    n, k = codes.shape
    bn = _block_n(layout)
    full = n // bn if layout != "pairs" else 0
    flat = out.view(-1)
    if full:
        q = codes[: full * bn]
        dst = flat[: full * bn * k // 2]
        if layout == "avx2":
            # per row block and k: 16 bytes, byte d = row d (low nibble) | row d + 16 (high nibble)
            q = q.view(full, 2, 16, k)
            torch.bitwise_or(q[:, 0], q[:, 1] << 4, out=dst.view(full, k, 16).transpose(1, 2))
        else:
            # per row block and k: 32 bytes, byte 16 b + d = row 16 b + d | row 32 + 16 b + d << 4
            q = q.view(full, 2, 2, 16, k)
            torch.bitwise_or(q[:, 0], q[:, 1] << 4, out=dst.view(full, k, 2, 16).permute(0, 2, 3, 1))
    rest = n - full * bn
    if rest:
        # the tail block (and every block of the plain kernel), per row block and k: byte j = row 2j | row 2j+1 << 4;
        # blocks start every BLOCK_N rows' worth of bytes
        q = codes[full * bn:]
        blocks = (rest + bn - 1) // bn
        for b in range(blocks):  # a tail is one block; the plain kernel's blocks are few (N / 32)
            rows = min(bn, rest - b * bn)
            qb = q[b * bn: b * bn + rows].view(rows // 2, 2, k)
            at = (full + b) * bn * k // 2
            dst = flat[at: at + rows * k // 2].view(k, rows // 2).t()
            torch.bitwise_or(qb[:, 0], qb[:, 1] << 4, out=dst)


def unpack_transposed(packed: torch.Tensor, k: int, out_t: torch.Tensor, layout: str | None = None) -> torch.Tensor:
    """The inverse of pack_codes, transposed: packed uint8 [N, K/2] -> codes as float32 into out_t [K, N].

    Transposed because each packed run of bytes holds one column k of a block of rows: writing W^T keeps both the
    reads and the writes in runs of 16; F.linear takes the transposed view without a copy.
    """
    layout = layout or _layout()
    if layout == "op":
        raise ValueError("this CPU's int4 layout is unknown to sluice; only the op can read it")
    n = packed.shape[0]
    bn = _block_n(layout)
    full = n // bn if layout != "pairs" else 0
    flat = packed.reshape(-1)
    if full:
        src = flat[: full * bn * k // 2]
        if layout == "avx2":  # byte (block, k, d) = rows d | d + 16
            src = src.view(full, k, 16).transpose(0, 1)  # [K, full, 16]
            dst = out_t[:, : full * bn].view(k, full, 2, 16)
        else:  # byte (block, k, b, d) = rows 16 b + d | 32 + 16 b + d
            src = src.view(full, k, 2, 16).transpose(0, 1)  # [K, full, 2, 16]
            dst = out_t[:, : full * bn].view(k, full, 2, 2, 16)
        dst[:, :, 0].copy_(src & 15)
        dst[:, :, 1].copy_(src >> 4)
    rest = n - full * bn
    for b in range((rest + bn - 1) // bn):  # byte (k, j) = rows 2j | 2j + 1
        rows = min(bn, rest - b * bn)
        at = (full + b) * bn * k // 2
        src = flat[at: at + rows * k // 2].view(k, rows // 2)
        dst = out_t[:, full * bn + b * bn: full * bn + b * bn + rows].view(k, rows // 2, 2)
        dst[..., 0].copy_(src & 15)
        dst[..., 1].copy_(src >> 4)
    return out_t


def scales_zeros(a: Affine, out: torch.Tensor | None = None) -> torch.Tensor:
    """A 4-bit Affine's per-group scale and zero as the op wants them: bf16 [K/group, N, 2] (into `out`)."""
    rows, n = a.codes.shape
    offset = 8 if a.codes.dtype == torch.int8 else 0  # signed codes are already code - 8
    zero = a.scale * float(8 - offset) if offset != 8 else torch.zeros_like(a.scale)
    if a.bias is not None:
        zero = zero + a.bias  # [N, G] float32, one rounding
    if out is None:
        out = torch.empty(n // a.group, rows, 2, dtype=torch.bfloat16)
    out[..., 0].copy_(a.scale.t())
    out[..., 1].copy_(zero.t())
    return out


def unsigned_codes(a: Affine) -> torch.Tensor:
    """The Affine's codes as the op's 0-15 (uint8 [N, K]); signed codes (Q4_0's q - 8) shifted back by 8."""
    if a.codes.dtype == torch.int8:
        return (a.codes + 8).view(torch.uint8)
    return a.codes


def dequantize_packed(packed: torch.Tensor, sz: torch.Tensor, group: int, k: int, out: torch.Tensor,
                      layout: str | None = None) -> torch.Tensor:
    """The weights the op computes with, (code - 8) * scale + zero with sz's bf16 values widened exactly, written
    into out (float32, N * K elements, laid out as W^T [K, N]); returns the [N, K] (transposed) view of it."""
    n = packed.shape[0]
    w_t = unpack_transposed(packed, k, out.view(k, n), layout)
    s = sz.float()  # [G, N, 2]
    scale, zero = s[..., 0].contiguous().unsqueeze(1), s[..., 1].contiguous().unsqueeze(1)  # [G, 1, N]
    # contiguous operands: a broadcast multiply by the strided s[..., 0] view took 1.7 ms instead of 0.2 ms (dev VM)
    g = w_t.view(k // group, group, n)
    g.sub_(8).mul_(scale).add_(zero)  # (code - 8) * scale is exact; one rounding in the add
    return w_t.t()


def mm(x: torch.Tensor, packed: torch.Tensor, group: int, sz: torch.Tensor) -> torch.Tensor:
    """y [T, N] = x [T, K] @ W^T with W packed (see the module docstring); x and sz bf16."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)
