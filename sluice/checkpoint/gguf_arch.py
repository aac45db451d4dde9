"""How llama.cpp stores an architecture (`GGUFArch`): what gguf_config.py and gguf_index.py read a GGUF file by.

The facts are the architecture's own: each models/<model_type>.py declares its `GGUF`, and whoever opens a file
(plan.open_index) hands the checkpoint layer the table of them (models.gguf_archs(): general.architecture -> facts),
so this layer never imports the model code above it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .ref import stored_as

#: GGUFArch.config's signature: (typed metadata of the file -- gguf_config.GGUFMeta --, the file's tensors by GGUF
#: name) -> the architecture's config.json keys
GGUFConfigHook = Callable[[Any, Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class GGUFArch:
    """How llama.cpp stores the architecture: checkpoint/gguf_config.py and gguf_index.py read files by this.

    The generic part of the config (sizes, heads, rope, eps, vocab, bos/eos, tied head, top-k, norm_topk_prob) is
    read the same for every architecture; `config` adds the architecture's own keys (expert count spelling,
    intermediate sizes, biases, dense layers) and may override norm_topk_prob.
    """

    name: str  # general.architecture, e.g. "qwen3moe"
    tensors: Mapping[str, str]  # blk.N.<GGUF suffix> -> model.layers.N.<config.json-world suffix>
    config: GGUFConfigHook
    # top-k renormalisation when expert_weights_norm is absent: what llama.cpp's graph passes to build_moe_ffn
    norm_topk_prob: bool
    # q/k rows stored permuted for llama.cpp's interleaved rope (its llama converter); read_tensor un-permutes them
    rope_permuted: bool = False
    # runs first, before any other key is read: raises ConfigError for files of this GGUF architecture that are not
    # this model (a llama file without experts is a dense Llama, not Mixtral)
    accept: Callable[[Any], None] | None = None
    # keys the `config` hook reads itself; the others are refused when they ask for math sluice does not do
    # (expert_gating_func other than softmax, expert_weights_scale, an expert_weights_norm != norm_topk_prob,
    # rope.scaling.yarn_log_multiplier)
    own_keys: frozenset[str] = frozenset()
    # config.json's model_type of the architecture (models.gguf_archs fills it from the module's MODEL_TYPE)
    model_type: str = ""
    # values the converter maps on the way to the file: config.json-world name (a whole name, or the suffix after a
    # dot: "input_layernorm.weight") -> a key of ref.STORED (zero-centred norms stored as 1 + w: "plus_one"); the
    # index marks those refs (TensorRef.values) and read_tensor gives back the Hugging Face values
    values: Mapping[str, str] = field(default_factory=dict)
    # rope.dimension_count may be below the head size (a partial rotary: partial_rotary_factor = dimension_count /
    # head size); without it the two must be equal
    partial_rope: bool = False
    # the architecture's tensors outside the blocks beyond token_embd / output_norm / output, as a function of the
    # config (`config`'s result): GGUF name -> config.json-world name (qwen4exp's final hyper-connection mixer, and
    # its n-gram table, which belongs to the layer its metadata names)
    other_tensors: Callable[[Mapping[str, Any]], Mapping[str, str]] | None = None
    # multi-head latent attention (deepseek2): head_count_kv, key_length and value_length describe llama.cpp's
    # one-head view of the latent (kv_lora_rank + rope dims), not the model's heads; the `config` hook gives those
    latent_attention: bool = False

    def global_tensors(self, config: Mapping[str, Any]) -> dict[str, str]:
        """GGUF name -> config.json-world name of its own tensors outside the blocks (`other_tensors`)."""
        return dict(self.other_tensors(config)) if self.other_tensors is not None else {}

    def values_of(self, name: str) -> str:
        """The ref.STORED key of config.json-world tensor `name` in this architecture's files ("" when stored as is)."""
        return stored_as(name, dict(self.values))


#: general.architecture -> its facts: the table a GGUF file is read by (models.gguf_archs() builds it)
GGUFArchs = Mapping[str, GGUFArch]
