"""torch's packed int4 CPU matmul (`aten._weight_int4pack_mm_for_cpu`) fed from 4-bit formats.

The op computes y = x @ W^T for x [T, K] (bf16 here) and W [N, K] given as
- packed codes uint8 [N, K/2]: the layout `aten._convert_weight_to_int4pack_for_cpu` writes from int32 codes 0-15,
  which depends on the CPU kernel torch dispatches to (rows in blocks of BLOCK_N = 32 on AVX2, 64 on AVX512, nibble
  pairs chosen for its unpacking; see `_layout`);
- scales_and_zeros [K/group, N, 2] in x's dtype, group 32/64/128/256: value = (code - 8) * scale + zero.

A 4-bit Affine (value = scale * c + bias, c = code or code - 8) maps onto it exactly in float32 terms with
scale = scale and zero = bias + (8 - offset) * scale; the op then holds scale and zero in bf16 (8 bits of mantissa),
which is the whole of its error against the exact dequantization (see kernels.py for measured numbers).

`pack_nibbles` writes the layout from the stored nibbles with a few torch ops straight into a preallocated buffer
(no codes tensor, no int32 copy, no allocation of the output; 1.8 ms for a [768 x 2048] Q4_K projection where the
op's route - unpacked codes -> int32 -> op -> copy - takes 6.8 ms, dev VM). Our layout is checked once per process
against the op itself, and the op is used instead (with its allocations) on a CPU whose layout this file does not
know. The f32 / f16 variants of the op are scalar loops on AVX2 (8-30 ms at 1 row): bf16 activations only.
"""

from __future__ import annotations

import functools

import torch


GROUPS = (32, 64, 128, 256)  # the group sizes the op accepts


@functools.cache
def _layout() -> str:
    """'avx512' / 'avx2' / 'pairs' (the kernel's BLOCK_N and nibble pairing), or 'op' when our packer disagrees with
    the op on this machine (then pack_nibbles calls the op)."""
    cap = torch.backends.cpu.get_cpu_capability()
    guess = "avx512" if cap.startswith("AVX512") else "avx2" if cap == "AVX2" else "pairs"
    g = torch.Generator().manual_seed(0)
    n, k = 2 * _block_n(guess) + 16, 64  # two full blocks and a tail
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    got = torch.empty(n, k // 2, dtype=torch.uint8)
    _pack(_pairs(codes), got, guess)
    return guess if torch.equal(got, want) else "op"


def layout_known() -> bool:
    """Whether sluice can write (and read back) the op's packed layout on this CPU."""
    return _layout() != "op"


def _block_n(layout: str) -> int:
    return 64 if layout == "avx512" else 32


def _pairs(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] -> nibble bytes [N, K/2, 1]: column 2j in the low nibble of byte j, 2j + 1 in the high one."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).unsqueeze(-1)


def pack_codes(codes: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 codes 0-15 [N, K] (N a multiple of 16, K even) -> the op's packed uint8 [N, K/2], into `out` if given."""
    n, k = codes.shape
    if k % 2:
        raise ValueError(f"int4 packing needs an even row length, got {k}")
    return pack_nibbles(_pairs(codes), out)


def pack_nibbles(qs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Stored 4-bit codes -> the op's packed uint8 [N, K/2] (into `out` if given), without unpacking them.

    qs: uint8 [N, *C, L], typically a strided view of the stored blocks: byte (n, c, l) holds column c * 2L + l of
    row n in its low nibble and column c * 2L + L + l in its high nibble (c counts the chunks of 2L columns in row
    order). Q4_0 / Q4_1 are [N, blocks, 16], Q4_K [N, blocks, 4, 32], MLX 4-bit [N, K/2, 1]. The op pairs row r with
    row r + 16 (or its neighbour) in a byte, so each output byte is (A & 15) | (B << 4) or (A >> 4) | (B & 0xF0) of
    two stored bytes A, B at the same column: four nibble ops and one transposing write per half, no codes tensor.
    """
    n = qs.shape[0]
    if n % 16:
        raise ValueError(f"int4 packing needs rows in multiples of 16, got {n}")
    k = qs[0].numel() * 2
    if out is None:
        out = torch.empty(n, k // 2, dtype=torch.uint8)
    layout = _layout()
    if layout == "op":  # TODO: a layout we have not seen; the op needs int32 codes and allocates its output
        codes = torch.stack((qs & 15, qs >> 4), dim=-2).reshape(n, k)
        out.copy_(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
    else:
        _pack(qs, out, layout)
    return out


def _write(a: torch.Tensor, b: torch.Tensor, lo_dst: torch.Tensor, hi_dst: torch.Tensor) -> None:
    """The low-nibble columns: a's low | b's low << 4; the high-nibble columns: a's high | b's high << 4.

    The strided stored bytes are gathered once, the nibble ops run contiguous, and one copy per half does the
    transposing write: Q4_0 (runs of 16 bytes) packs in 1.2 ms instead of 2.1 ms with the ops writing the strided
    destination themselves (768 x 2048, thread CPU time, dev VM); Q4_K and MLX 4-bit are the same either way.
    """
    a, b = a.contiguous(), b.contiguous()
    lo_dst.copy_((a & 15) | (b << 4))  # uint8 << 4 drops b's high nibble
    hi_dst.copy_((a >> 4) | (b & 0xF0))


def _pack(qs: torch.Tensor, out: torch.Tensor, layout: str) -> None:
    n, cdims, ell = qs.shape[0], tuple(qs.shape[1:-1]), qs.shape[-1]
    nc = len(cdims)
    k = qs[0].numel() * 2
    bn = _block_n(layout)
    full = n // bn if layout != "pairs" else 0
    flat = out.view(-1)
    if full:
        dst = flat[: full * bn * k // 2]
        if layout == "avx2":
            # per row block and column: 16 bytes, byte d = row d (low nibble) | row d + 16 (high nibble)
            a, b = qs[: full * bn].unflatten(0, (full, 2, 16)).unbind(1)  # [full, 16, *C, L]
            dst = dst.view(full, *cdims, 2, ell, 16)  # column (c, half, l), then d
            lo, hi = (dst.select(nc + 1, h).movedim(-1, 1) for h in (0, 1))  # [full, 16, *C, L]
        else:
            # per row block and column: 32 bytes, byte 16 e + d = row 16 e + d | row 32 + 16 e + d << 4
            a, b = qs[: full * bn].unflatten(0, (full, 2, 2, 16)).unbind(1)  # [full, 2, 16, *C, L]
            dst = dst.view(full, *cdims, 2, ell, 2, 16)
            lo, hi = (dst.select(nc + 1, h).movedim((-2, -1), (1, 2)) for h in (0, 1))
        _write(a, b, lo, hi)
    rest = n - full * bn
    for blk in range((rest + bn - 1) // bn):  # a tail is one block; the plain kernel's blocks are few (N / 32)
        # per row block and column: byte j = row 2j | row 2j + 1 << 4; blocks start every BLOCK_N rows' worth of bytes
        rows = min(bn, rest - blk * bn)
        r0 = full * bn + blk * bn
        a, b = qs[r0: r0 + rows].unflatten(0, (rows // 2, 2)).unbind(1)  # [rows/2, *C, L]
        dst = flat[r0 * k // 2: (r0 + rows) * k // 2].view(*cdims, 2, ell, rows // 2)
        lo, hi = (dst.select(nc, h).movedim(-1, 0) for h in (0, 1))
        _write(a, b, lo, hi)


def unpack_codes(packed: torch.Tensor, k: int, out: torch.Tensor | None = None,
                 layout: str | None = None) -> torch.Tensor:
    """The inverse of pack_codes: packed uint8 [N, K/2] -> codes uint8 [N, K] (into `out` if given).

    Each packed run of 16 or 32 bytes holds one column k of a block of rows; the block is transposed as bytes first
    (contiguous), then split into nibbles with contiguous ops: 0.47 ms for 768 x 2048 codes, against 1.4 ms for
    nibble ops reading the transposed view directly (thread CPU time, dev VM).
    """
    layout = layout or _layout()
    if layout == "op":
        raise ValueError("this CPU's int4 layout is unknown to sluice; only the op can read it")
    n = packed.shape[0]
    if out is None:
        out = torch.empty(n, k, dtype=torch.uint8)
    bn = _block_n(layout)
    full = n // bn if layout != "pairs" else 0
    flat = packed.reshape(-1)
    if full:
        src = flat[: full * bn * k // 2]
        if layout == "avx2":  # byte (block, k, d) = rows d | d + 16
            src = src.view(full, k, 16).transpose(1, 2).contiguous()  # [full, 16, K]
            dst = out[: full * bn].view(full, 2, 16, k)
        else:  # byte (block, k, b, d) = rows 16 b + d | 32 + 16 b + d
            src = src.view(full, k, 32).transpose(1, 2).contiguous().view(full, 2, 16, k)
            dst = out[: full * bn].view(full, 2, 2, 16, k)
        torch.bitwise_and(src, 15, out=dst[:, 0])
        torch.bitwise_right_shift(src, 4, out=dst[:, 1])
    rest = n - full * bn
    for b in range((rest + bn - 1) // bn):  # byte (k, j) = rows 2j | 2j + 1
        rows = min(bn, rest - b * bn)
        at = (full + b) * bn * k // 2
        src = flat[at: at + rows * k // 2].view(k, rows // 2).t().contiguous()  # [rows/2, K]
        dst = out[full * bn + b * bn: full * bn + b * bn + rows].view(rows // 2, 2, k)
        torch.bitwise_and(src, 15, out=dst[:, 0])
        torch.bitwise_right_shift(src, 4, out=dst[:, 1])
    return out


def scales_zeros(scale: torch.Tensor, bias: torch.Tensor | None, code_offset: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-group value = scale * (u - code_offset) (+ bias) for stored codes u in 0-15 -> the op's scale and zero,
    bf16 [K/group, N, 2] (into `out`): zero = bias + (8 - code_offset) * scale, in float32, then rounded."""
    zero = scale * float(8 - code_offset) if code_offset != 8 else torch.zeros_like(scale)
    if bias is not None:
        zero = zero + bias  # [N, G] float32, one rounding
    if out is None:
        out = torch.empty(scale.shape[1], scale.shape[0], 2, dtype=torch.bfloat16)
    out[..., 0].copy_(scale.t())
    out[..., 1].copy_(zero.t())
    return out


def dequantize_packed(packed: torch.Tensor, sz: torch.Tensor, group: int, k: int, out: torch.Tensor,
                      layout: str | None = None) -> torch.Tensor:
    """The weights the op computes with, (code - 8) * scale + zero with sz's bf16 values widened exactly, as float32
    [N, K] into out (N * K elements); returns out viewed [N, K]."""
    n = packed.shape[0]
    w = out.view(n, k)
    w.copy_(unpack_codes(packed, k, layout=layout))
    s = sz.float()  # [G, N, 2]
    # contiguous [N, G, 1] operands: a broadcast multiply by a strided view of sz took 1.7 ms instead of 0.2 ms
    scale, zero = s[..., 0].t().contiguous().unsqueeze(-1), s[..., 1].t().contiguous().unsqueeze(-1)
    w.view(n, k // group, group).sub_(8).mul_(scale).add_(zero)  # (code - 8) * scale is exact; one rounding in the add
    return w


def mm(x: torch.Tensor, packed: torch.Tensor, group: int, sz: torch.Tensor) -> torch.Tensor:
    """y [T, N] = x [T, K] @ W^T with W packed (see the module docstring); x and sz bf16."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)
