"""What every architecture reads from config.json (`BaseArgs`, validated by schema.py) and shared helpers."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..checkpoint.multimodal import text_config
from .rope import RopeConfig
from .schema import cfg, parse

if TYPE_CHECKING:
    from .spec import Spec

CONFIG = "config.json"
#: Bounds on sizes that are used before any checkpoint shape can contradict them: per-layer lists are built from
#: num_hidden_layers, and the rope frequencies (head_dim / 2 floats) are computed to validate the rope. Real models:
#: <= 128 layers, head_dim <= 256; these leave 30x room and keep a hostile config from allocating gigabytes.
MAX_LAYERS = 4096
MAX_HEAD_DIM = 8192


#: the activations blocks.ACTIVATIONS computes (kept here so config validation does not import torch)
ACTIVATIONS = ("silu", "gelu", "relu")


def sliding_windows(n_layers: int, window: int | None, layer_types: list[str] | None = None) -> list[int | None]:
    """Per-layer attention window: `layer_types` ("sliding_attention"/"full_attention") when given, else all."""
    if not window:
        return [None] * n_layers
    if layer_types is None:
        return [window] * n_layers
    return [window if t == "sliding_attention" else None for t in layer_types]


def moe_layer_flags(n_layers: int, num_experts: int, sparse_step: int, mlp_only: list[int]) -> list[bool]:
    """Which layers are sparse: the transformers rule for Qwen-MoE (decoder_sparse_step, mlp_only_layers)."""
    dense = set(mlp_only)
    return [
        (i not in dense) and num_experts > 0 and sparse_step > 0 and (i + 1) % sparse_step == 0
        for i in range(n_layers)
    ]


@dataclasses.dataclass(kw_only=True)
class BaseArgs:
    """Fields every architecture here reads the same way; each `ModelArgs` subclasses this and adds its own.

    Every config.json field the math reads is declared with `cfg(...)` (schema.py: JSON type, range, aliases);
    `from_dict` validates them all. An architecture overrides a default with `override(BaseArgs, name, value)`
    and adds relations a bound cannot state in `config_problems()` (calling super's).
    """

    hidden_size: int = cfg(ge=1)
    num_hidden_layers: int = cfg(ge=1, le=MAX_LAYERS)
    num_attention_heads: int = cfg(ge=1)
    num_key_value_heads: int | None = cfg(None, ge=1, divides="num_attention_heads")  # null: = heads (no GQA)
    head_dim: int | None = cfg(None, ge=1, le=MAX_HEAD_DIM)  # null: hidden_size / num_attention_heads
    vocab_size: int = cfg(ge=1)
    # transformers>=5 writes qwen3_moe's expert count as num_local_experts, hub configs say num_experts; Mixtral's
    # hub configs say num_local_experts
    num_experts: int = cfg(ge=1, aliases=("num_local_experts",))
    num_experts_per_tok: int = cfg(ge=1, le="num_experts")
    rms_norm_eps: float = cfg(1e-6, gt=0, lt=1)  # <= 0: rsqrt of a negative or zero mean square (NaN)
    max_position_embeddings: int = cfg(4096, ge=1)
    tie_word_embeddings: bool = cfg(False)
    hidden_act: str = cfg("silu", choices=ACTIVATIONS)
    # ids that end generation (an id beyond the vocabulary never matches: transformers only warns about it)
    eos_token_id: int | list[int] | None = cfg(None, ge=0)
    config: dict = dataclasses.field(default_factory=dict, repr=False)  # the whole config.json (rope keys)
    source: str = dataclasses.field(default=CONFIG, repr=False)  # the file it came from, named in errors
    rope: RopeConfig | None = dataclasses.field(default=None, repr=False)  # validated by from_dict

    #: rope_theta when config.json has none (transformers' `default_theta` of the architecture)
    DEFAULT_THETA = 10000.0

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    def moe_layers(self) -> list[bool]:
        """Per layer: sparse (True) or dense. Every layer unless the architecture says otherwise."""
        return [True] * self.num_hidden_layers

    def config_problems(self) -> Iterator[tuple[str, str]]:
        """(field, what is wrong and what is accepted) for relations between fields that a bound cannot state."""
        if self.config.get("head_dim") is None and self.hidden_size % self.num_attention_heads:
            yield "hidden_size", (
                f"{self.hidden_size} is not a multiple of num_attention_heads ({self.num_attention_heads}); "
                "config.json gives no head_dim, so head_dim = hidden_size / num_attention_heads must be whole: "
                "add head_dim or fix the sizes"
            )
        if not any(self.moe_layers()):
            all_listed = set(range(self.num_hidden_layers)) <= set(getattr(self, "mlp_only_layers", None) or [])
            yield "mlp_only_layers" if all_listed else "decoder_sparse_step", (
                "no layer is sparse (decoder_sparse_step / mlp_only_layers leave only dense MLPs); sluice runs "
                "mixture-of-experts models: expected at least one MoE layer"
            )

    @classmethod
    def from_dict(cls, config: dict, source: str | os.PathLike[str] = CONFIG):
        """ModelArgs from a parsed config.json, every field the math reads validated (keys it does not declare are
        ignored, mlx-lm style); a multimodal config.json is read as its text model's (checkpoint/multimodal.py).
        `source`: the file's path, named with the field in every ConfigError."""
        source = str(source)
        config = text_config(config)
        args = parse(cls, config, source=source, extra={"config": config, "source": source})
        args.rope = RopeConfig.from_config(config, args.head_dim, cls.DEFAULT_THETA, args.max_position_embeddings,
                                           source=source)
        return args

    def base_spec(self, **arch) -> "Spec":
        """The Spec fields common to all architectures, plus the architecture's own (`arch`)."""
        from .spec import Spec

        return Spec(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            n_layers=self.num_hidden_layers,
            n_heads=self.num_attention_heads,
            n_kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope=self.rope or RopeConfig.from_config(
                self.config, self.head_dim, self.DEFAULT_THETA, self.max_position_embeddings, source=self.source
            ),
            num_experts=self.num_experts,
            top_k=self.num_experts_per_tok,
            moe_layers=self.moe_layers(),
            tie_word_embeddings=self.tie_word_embeddings,
            hidden_act=self.hidden_act,
            **arch,
        )


@dataclasses.dataclass(kw_only=True)
class GenerationArgs:
    """What sluice reads from generation_config.json (optional file)."""

    eos_token_id: int | list[int] | None = cfg(None, ge=0)


def dense_and_grouped_router_problems(args) -> Iterator[tuple[str, str]]:
    """config.json problems shared by the first_k_dense_replace + grouped sigmoid router families (glm4_moe,
    deepseek_v3): the dense layers' MLP size, and expert groups the router can score and select from."""
    if args.first_k_dense_replace and args.intermediate_size < 1:
        yield "intermediate_size", (
            f"{'got 0' if 'intermediate_size' in args.config else 'missing'}; the first "
            f"{args.first_k_dense_replace} layers are dense (first_k_dense_replace), so their MLP size is "
            "needed: expected an integer >= 1")
    per_group = args.num_experts // args.n_group
    if args.num_experts % args.n_group:
        key = next((k for k in ("n_routed_experts", "num_local_experts") if k in args.config), "num_experts")
        yield "n_group", (f"got {args.n_group}; expected a divisor of {key} ({args.num_experts}): the experts "
                          "split into n_group equal groups")
    elif per_group < 2:
        # a group's score is the sum of its two best experts' (transformers' topk(2) fails on fewer)
        yield "n_group", (f"{args.n_group} groups of {args.num_experts} experts leave {per_group} per group; "
                          "expected at least 2 experts per group")
    elif args.num_experts_per_tok > args.topk_group * per_group:
        yield "num_experts_per_tok", (
            f"got {args.num_experts_per_tok}, but only topk_group ({args.topk_group}) groups of {per_group} "
            f"experts are selectable: expected at most {args.topk_group * per_group}")


def eos_ids(*values: int | list[int] | None) -> set[int]:
    """The union of validated eos_token_id values (an id or a list of ids; None for none)."""
    out: set[int] = set()
    for v in values:
        out.update([v] if isinstance(v, int) else (v or []))
    return out
