"""Random stored weights for a QuantSpec (tests and benchmarks; test data, so it lives in tests/): random codes, finite scales of a realistic size."""

from __future__ import annotations

import numpy as np
import torch

from sluice.checkpoint.formats import BY_NAME
from sluice.quant.spec import QuantSpec

#: byte offsets of the f16 scale fields inside one block of each ggml type. IQ1_M's one f16 is spread over the top
#: nibbles of the four u16 words at byte 48 (read_f16 / write_f16 handle it)
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
              "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,), "TQ1_0": (52,), "TQ2_0": (64,), "IQ1_S": (0,),
              "IQ1_M": (48,), "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,),
              "IQ4_NL": (0,), "IQ4_XS": (0,)}


def read_f16(b: np.ndarray, name: str, at: int) -> np.ndarray:
    """uint16 [...]: the bits of the f16 field at byte `at` of blocks b (uint8 [..., block_bytes]) of type name."""
    if name == "IQ1_M":
        w = b[..., 48:56].copy().view(np.uint16)  # [..., 4]: nibble k of d is the top nibble of word k
        return (w[..., 0] >> 12) | ((w[..., 1] >> 8) & 0xF0) | ((w[..., 2] >> 4) & 0xF00) | (w[..., 3] & 0xF000)
    return b[..., at:at + 2].copy().view(np.uint16)[..., 0]


def write_f16(b: np.ndarray, name: str, at: int, v: np.ndarray) -> None:
    """Set the f16 field at byte `at` of blocks b (uint8 [..., block_bytes], in place) to the bits v (uint16 [...])."""
    v = np.ascontiguousarray(v, dtype=np.uint16)
    if name == "IQ1_M":
        w = b[..., 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
        for k in range(4):
            w[..., k] |= ((v >> (4 * k)) & 0xF) << 12
        b[..., 48:56] = w.view(np.uint8)
    else:
        b[..., at:at + 2] = v[..., None].view(np.uint8)


def random_stored(spec: QuantSpec, seed: int = 0, scale: float = 1e-3) -> torch.Tensor:
    """uint8 [spec.nbytes]: every part filled with random bytes, then each scale field set to a finite value of
    magnitude ~`scale` (random sign for ggml d; dmin / MLX biases too) so the weights are ~N(0, 0.01)-sized."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (spec.nbytes,), dtype=torch.uint8, generator=g)
    parts = {p.name: p.view(raw) for p in spec.parts}
    if spec.family == "ggml":
        blocks = parts["blocks"]
        if spec.plain:
            dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[spec.name]
            blocks.view(-1).view(dtype).copy_(torch.randn(blocks.numel() // dtype.itemsize, generator=g) * 0.02)
        elif spec.name in F16_FIELDS:
            b = blocks.view(spec.out_features, -1, BY_NAME[spec.name].block_bytes).numpy()  # shares the memory
            for at in F16_FIELDS[spec.name]:
                d = (torch.rand(b.shape[:2], generator=g) + 0.5) * scale
                d = d * (torch.randint(0, 2, d.shape, generator=g) * 2 - 1)
                write_f16(b, spec.name, at, d.half().view(torch.int16).numpy().view(np.uint16))
        elif spec.name == "MXFP4":
            b = blocks.view(spec.out_features, -1, 17)
            b[..., 0].copy_(torch.randint(115, 122, b.shape[:2], generator=g))
    elif spec.family == "mlx":
        for name in ("scales", "biases"):
            p = parts[name]
            p.copy_(torch.randn(p.shape, generator=g) * scale * (1 if name == "scales" else 8))
    else:  # mxfp4: 2^(s-127) around 1e-3..1e-2
        parts["scales"].copy_(torch.randint(115, 122, parts["scales"].shape, generator=g))
    return raw


def random_expert_slots(fmt, n: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, fmt.nbytes]: n experts of an ExpertFormat (store/layout.py), each slot's gate, up and down filled
    by random_stored at their offsets (expert e's part k seeded seed + 10 * e + k)."""
    slots = torch.zeros(n, fmt.nbytes, dtype=torch.uint8)
    for e in range(n):
        for k, (spec, at) in enumerate(((fmt.gate, 0), (fmt.up, fmt.up_offset), (fmt.down, fmt.down_offset))):
            slots[e, at:at + spec.nbytes] = random_stored(spec, seed=seed + 10 * e + k)
    return slots
