"""A text model shipped inside a multimodal checkpoint (the hub's Qwen3.5 / 3.6 `*ForConditionalGeneration`, as
transformers>=5 writes its vision-language models): config.json nests the text model's config under `text_config`
and the text model's tensors live under `model.language_model.*`, beside a vision tower (`model.visual.*`) and, on
the hub, a multi-token-prediction head (`mtp.*`). sluice runs the text model: the index presents it as a text-only
checkpoint (the config flattened, `model.language_model.X` named `model.X`); nothing reads the other tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

TEXT_PREFIX = "model.language_model."  # the text model's tensors in a multimodal checkpoint
PLAIN_PREFIX = "model."  # ... and in a text-only one
SUBCONFIGS = ("text_config", "vision_config", "audio_config")

V = TypeVar("V")


def text_config(config: dict) -> dict:
    """The text model's config of a multimodal config.json: its `text_config` keys over the top-level ones (the
    sub-configs dropped), keeping the top-level model_type (it names the architecture: qwen3_5_moe, where the text
    config says qwen3_5_moe_text). A config without a `text_config` object is returned as is."""
    text = config.get("text_config") if isinstance(config, dict) else None
    if not isinstance(text, dict):
        return config
    out = {k: v for k, v in config.items() if k not in SUBCONFIGS}
    out.update(text)
    if "model_type" in config:
        out["model_type"] = config["model_type"]
    return out


def is_wrapped(names: Mapping[str, object]) -> bool:
    """Whether the tensors are a multimodal checkpoint's: the text model under TEXT_PREFIX, none under PLAIN_PREFIX
    besides it."""
    return f"{TEXT_PREFIX}embed_tokens.weight" in names and f"{PLAIN_PREFIX}embed_tokens.weight" not in names


def text_tensors(tensors: dict[str, V]) -> dict[str, V]:
    """The tensors with the text model's under their text-only names (`model.language_model.X` -> `model.X`); the
    others (vision tower, mtp head, lm_head) keep theirs. Tensors of a text-only checkpoint are returned as is."""
    if not is_wrapped(tensors):
        return tensors
    n = len(TEXT_PREFIX)
    return {(PLAIN_PREFIX + name[n:] if name.startswith(TEXT_PREFIX) else name): t for name, t in tensors.items()}
