"""Helpers shared by the per-architecture `ModelArgs` dataclasses."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, TypeVar

from ..errors import ConfigError

T = TypeVar("T")


def from_dict(cls: type[T], config: dict[str, Any]) -> T:
    """Build a ModelArgs dataclass from config.json, ignoring keys it does not declare (mlx-lm style).

    A required field missing from config.json is a ConfigError naming it.
    """
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs = {k: v for k, v in config.items() if k in names}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"config.json is missing a required field for {cls.__module__}: {e}") from None


def sliding_windows(n_layers: int, window: int | None, layer_types: list[str] | None = None) -> list[int | None]:
    """Per-layer attention window: `layer_types` ("sliding_attention"/"full_attention") when given, else all."""
    if not window:
        return [None] * n_layers
    if layer_types is None:
        return [window] * n_layers
    return [window if t == "sliding_attention" else None for t in layer_types]


def moe_layer_flags(n_layers: int, num_experts: int, sparse_step: int, mlp_only: list[int]) -> list[bool]:
    """Which layers are sparse: the transformers rule for Qwen-MoE (decoder_sparse_step, mlp_only_layers)."""
    return [
        (i not in mlp_only) and num_experts > 0 and sparse_step > 0 and (i + 1) % sparse_step == 0
        for i in range(n_layers)
    ]


@dataclasses.dataclass(kw_only=True)
class BaseArgs:
    """Fields every architecture here reads the same way; each `ModelArgs` subclasses this and adds its own."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_experts_per_tok: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    config: dict = dataclasses.field(default_factory=dict, repr=False)  # the whole config.json (rope keys)

    #: rope_theta when config.json has none (transformers' `default_theta` of the architecture)
    DEFAULT_THETA = 10000.0
    #: other spellings of a field in config.json (transformers' attribute_map), e.g. transformers>=5 writes
    #: qwen3_moe's expert count as num_local_experts while hub configs say num_experts
    ALIASES: ClassVar[dict[str, str]] = {}

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.hidden_act not in ("silu", "gelu", "relu"):
            raise ConfigError(f"config.json: hidden_act {self.hidden_act!r} is not supported (silu, gelu, relu)")

    @classmethod
    def from_dict(cls, config: dict):
        """ModelArgs from a parsed config.json."""
        values = dict(config)
        for alias, name in cls.ALIASES.items():
            if name not in values and alias in values:
                values[name] = values[alias]
        return from_dict(cls, {**values, "config": config})

    def base_spec(self, **arch) -> "Spec":
        """The Spec fields common to all architectures, plus the architecture's own (`arch`)."""
        from .blocks import Spec
        from .rope import RopeConfig

        return Spec(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            n_layers=self.num_hidden_layers,
            n_heads=self.num_attention_heads,
            n_kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope=RopeConfig.from_config(
                self.config, self.head_dim, self.DEFAULT_THETA, self.max_position_embeddings
            ),
            top_k=self.num_experts_per_tok,
            tie_word_embeddings=self.tie_word_embeddings,
            hidden_act=self.hidden_act,
            **arch,
        )
