"""Rotary position embeddings: inverse frequencies for the rope types these models use, and the cos/sin table.

The formulas follow `transformers.modeling_rope_utils` so that logits match the reference; the table is built once
for the whole context at load time (float32 math, cast to the compute dtype like the reference does per step).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from ..quant import native
from ..quant.native import BEST, ops
from .schema import cfg, parse, show


SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")
#: keys a rope type cannot do without (transformers' required keys; original_max_position_embeddings defaults to
#: max_position_embeddings there too, and yarn's factor may be null: then max_position_embeddings / original)
REQUIRED_BY_TYPE = {"default": (), "linear": ("factor",), "yarn": (), "llama3": ("factor", "low_freq_factor",
                                                                               "high_freq_factor")}
#: largest attention scaling (cos/sin multiplier) accepted. YaRN's own formula gives 1.0-1.5 for real context
#: extensions (0.1 * ln(factor) + 1); q.k grows with its square, so beyond this only overflow lies ahead.
MAX_ATTENTION_SCALING = 10.0


@dataclass(kw_only=True)
class RopeKeys:
    """The top-level config.json keys about rope."""

    rope_theta: float | None = cfg(None, gt=1)
    partial_rotary_factor: float | None = cfg(None, gt=0, le=1)
    rope_scaling: dict | None = cfg(None)  # before transformers 5
    rope_parameters: dict | None = cfg(None)  # transformers>=5


@dataclass(kw_only=True)
class RopeArgs:
    """One rope dict (`rope_parameters`, or `rope_scaling`) after the top-level rope_theta and
    partial_rotary_factor are merged in as transformers does. Nulls count as absent."""

    rope_type: str | None = cfg(None, choices=SUPPORTED_ROPE_TYPES)
    type: str | None = cfg(None, choices=SUPPORTED_ROPE_TYPES)  # the old spelling of rope_type
    rope_theta: float = cfg(gt=1)  # base > 1: frequencies must fall with the dimension (yarn divides by log(base))
    partial_rotary_factor: float = cfg(1.0, gt=0, le=1)
    factor: float | None = cfg(None, ge=1)
    original_max_position_embeddings: int | None = cfg(None, ge=1)
    low_freq_factor: float | None = cfg(None, gt=0)
    high_freq_factor: float | None = cfg(None, gt="low_freq_factor")
    attention_factor: float | None = cfg(None, gt=0, le=MAX_ATTENTION_SCALING)
    beta_fast: float | None = cfg(None, gt=0)
    beta_slow: float | None = cfg(None, gt=0)
    mscale: float | None = cfg(None, ge=0)
    mscale_all_dim: float | None = cfg(None, ge=0)
    truncate: bool = cfg(True)

    @property
    def kind(self) -> str:
        return self.rope_type or self.type or "default"

    def config_problems(self) -> Iterator[tuple[str, str]]:
        for key in REQUIRED_BY_TYPE[self.kind]:
            if getattr(self, key) is None:
                need = ", ".join(REQUIRED_BY_TYPE[self.kind])
                yield key, f"missing; rope type {self.kind!r} needs {need}"


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
        cls,
        config: dict,
        head_dim: int,
        default_theta: float = 10000.0,
        max_positions: int = 4096,
        source: str = "config.json",
    ) -> "RopeConfig":
        """Read and validate both spellings: transformers>=5 `rope_parameters` and the older `rope_theta` +
        `rope_scaling` (which wins when both are given, as in transformers). `max_positions`: the validated
        max_position_embeddings. ConfigError names the key in `source` and what is accepted."""
        keys = parse(RopeKeys, config, source=source)
        name = "rope_scaling" if keys.rope_scaling else "rope_parameters" if keys.rope_parameters else ""
        given = keys.rope_scaling or keys.rope_parameters or {}
        nested = [k for k, v in given.items() if isinstance(v, dict)]
        if nested:
            raise ConfigError(f"holds per-layer-type rope parameters ({', '.join(map(repr, nested[:4]))}); sluice "
                              "supports one rope for all layers", file=source, field=name)
        merged = {k: v for k, v in given.items() if v is not None}
        merged.setdefault("rope_theta", default_theta if keys.rope_theta is None else keys.rope_theta)
        if keys.partial_rotary_factor is not None:
            merged.setdefault("partial_rotary_factor", keys.partial_rotary_factor)
        args = parse(RopeArgs, merged, source=source, prefix=f"{name}." if name else "")
        params = {f: getattr(args, f) for f in ("factor", "original_max_position_embeddings", "low_freq_factor",
                                                "high_freq_factor", "attention_factor", "beta_fast", "beta_slow",
                                                "mscale", "mscale_all_dim")}
        rc = cls(
            theta=args.rope_theta,
            head_dim=head_dim,
            max_position_embeddings=max_positions,
            rope_type=args.kind,
            partial_rotary_factor=args.partial_rotary_factor,
            params={**{k: v for k, v in params.items() if v is not None}, "truncate": args.truncate},
        )
        rc._check(source, name)
        return rc

    def _check(self, source: str, name: str) -> None:
        """The rotary dims fit the head and the frequencies and scaling are finite (NaN logits otherwise)."""
        dim = int(self.head_dim * self.partial_rotary_factor)
        rot = dim + dim % 2  # an odd rotary dim is rounded up (transformers' arange(0, dim, 2))
        if dim < 1 or rot > self.head_dim:
            key = "head_dim" if self.partial_rotary_factor == 1 else f"{name}.partial_rotary_factor".lstrip(".")
            raise ConfigError(
                f"rope rotates pairs of dimensions: head_dim {self.head_dim} x partial_rotary_factor "
                f"{self.partial_rotary_factor} gives {dim} rotary dims, which must be >= 1 and, rounded up to even, "
                f"<= head_dim; use an even head_dim (head_dim defaults to hidden_size / num_attention_heads)",
                file=source, field=key,
            )
        try:
            freq, scale = inv_freq(self)
            ok = bool(torch.isfinite(freq).all()) and 0 < scale <= MAX_ATTENTION_SCALING
        except (ArithmeticError, ValueError):  # math.floor(inf), a zero denominator
            ok, scale = False, float("nan")
        if not ok:
            p = {k: v for k, v in self.params.items() if k != "truncate"}
            raise ConfigError(
                f"rope type {self.rope_type!r} with rope_theta {self.theta} and {show(p)} gives non-finite "
                f"frequencies or an attention scaling ({scale:.3g}) outside (0, {MAX_ATTENTION_SCALING:g}]; "
                "real configs use factor 1-128, beta_fast/beta_slow ~32/1, mscale ~1",
                file=source, field=name or "rope_theta",
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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, path: int = BEST) -> torch.Tensor:
    """x [heads, T, D] rotated by cos/sin [T, rot] on its first `rot` dims (rot == D unless partial rotary). bf16
    runs as one native call (ops.rope_bf16, the same bits; ~10 torch ops otherwise, twice per layer); `path`: the
    model's Compute.path."""
    if (x.dtype is torch.bfloat16 and cos.dtype is torch.bfloat16 and native.available() and x.dim() == 3
            and x.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous()):
        return ops.rope_bf16(x, cos, sin, path=path)
    rot = cos.shape[-1]
    xr, xp = (x, None) if rot == x.shape[-1] else (x[..., :rot], x[..., rot:])
    half = rot // 2
    rotated = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
    out = xr * cos + rotated * sin
    return out if xp is None else torch.cat((out, xp), dim=-1)
