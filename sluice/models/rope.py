"""Rotary position embeddings: inverse frequencies for the rope types these models use, and the cos/sin table.

The formulas follow `transformers.modeling_rope_utils` so that logits match the reference; the table is built once
for the whole context at load time (float32 math, cast to the compute dtype like the reference does per step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


@dataclass
class RopeConfig:
    """What config.json says about rope. `params` keeps the scaling keys (factor, beta_fast, ...)."""

    theta: float
    head_dim: int
    max_position_embeddings: int
    rope_type: str = "default"
    partial_rotary_factor: float = 1.0
    params: dict = field(default_factory=dict)

    @classmethod
    def from_config(
        cls, config: dict, head_dim: int, default_theta: float = 10000.0, max_positions: int = 4096
    ) -> "RopeConfig":
        """Read both spellings: transformers>=5 `rope_parameters` and the older `rope_theta` + `rope_scaling`."""
        params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = params.get("rope_theta", config.get("rope_theta", default_theta))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"config.json: rope type {rope_type!r} (rope_parameters/rope_scaling) is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        return cls(
            theta=float(theta),
            head_dim=head_dim,
            max_position_embeddings=int(config.get("max_position_embeddings", max_positions)),
            rope_type=rope_type,
            partial_rotary_factor=float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))),
            params=params,
        )


def inv_freq(rc: RopeConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] (float32) and the attention scaling applied to cos/sin."""
    dim = int(rc.head_dim * rc.partial_rotary_factor)
    base = rc.theta
    exps = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    freq = 1.0 / (base**exps)
    p = rc.params
    if rc.rope_type == "default":
        return freq, 1.0
    if rc.rope_type == "linear":
        return freq / p["factor"], 1.0
    if rc.rope_type == "llama3":
        factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old_ctx = p.get("original_max_position_embeddings", rc.max_position_embeddings)
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > old_ctx / lo, freq / factor, freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / hi) * ~(wavelen > old_ctx / lo)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn
    orig = p.get("original_max_position_embeddings", rc.max_position_embeddings)
    factor = p.get("factor") or rc.max_position_embeddings / orig
    attn = p.get("attention_factor")
    mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attn is None:
        attn = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all else get_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float) / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return inter * (1 - keep) + extra * keep, float(attn)


def rope_table(rc: RopeConfig, n_pos: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [n_pos, rot_dim] in `dtype`, computed in float32 exactly as the reference does per step."""
    freq, scale = inv_freq(rc)
    pos = torch.arange(n_pos, dtype=torch.int64).float()
    freqs = pos[:, None] * freq[None, :]  # [P, rot/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, rot]
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, T, D] rotated by cos/sin [T, rot] on its first `rot` dims (rot == D unless partial rotary)."""
    rot = cos.shape[-1]
    xr, xp = (x, None) if rot == x.shape[-1] else (x[..., :rot], x[..., rot:])
    half = rot // 2
    rotated = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
    out = xr * cos + rotated * sin
    return out if xp is None else torch.cat((out, xp), dim=-1)
