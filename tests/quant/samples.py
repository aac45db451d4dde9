"""Random stored weights for a QuantSpec (tests and benchmarks; test data, so it lives in tests/): random codes, finite scales of a realistic size."""

from __future__ import annotations

import torch

from sluice.quant.spec import QuantSpec

#: byte offsets of the f16 scale fields inside one block of each ggml type
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
              "Q6_K": (208,)}
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


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
            b = blocks.view(spec.out_features, -1, BLOCK_BYTES[spec.name])
            for at in F16_FIELDS[spec.name]:
                d = (torch.rand(b.shape[:2], generator=g) + 0.5) * scale
                d = d * (torch.randint(0, 2, d.shape, generator=g) * 2 - 1)
                b[..., at:at + 2].copy_(d.half().unsqueeze(-1).view(torch.uint8))
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
