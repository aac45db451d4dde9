"""Qwen3.5 / 3.6 MoE in the text-only layout (`model_type: qwen3_5_moe_text`): what transformers'
`Qwen3_5MoeForCausalLM` writes, the text model's config at the top level and its tensors under `model.layers.*`
(no vision tower). The model is qwen3_5_moe's (models/qwen3_5_moe.py); only the checkpoint's layout differs. Its GGUF
facts are qwen3_5_moe's object: `sluice export-gguf` writes either layout as llama.cpp's qwen35moe, and a qwen35moe
GGUF opens as qwen3_5_moe (the first architecture of that name: models.gguf_archs)."""

from __future__ import annotations

from .arch import SynthDefaults, SynthWrap
from .qwen3_5_moe import (EXPERT_PROJ, GGUF, INTERMEDIATE_KEY, MLX_MOE, MLX_VALUES, MOE_PREFIXES, ROUTER, ModelArgs,
                          expert_layer, layer_tensors, layers, synth_config, synth_expert_nbytes, synth_experts)
from .qwen3_next import mtp_tensors
from .spec import Spec

MODEL_TYPE = "qwen3_5_moe_text"
SYNTH = SynthDefaults("Qwen3_5MoeForCausalLM", num_experts=256, top_k=8, rope_theta=1e7, rms_norm_eps=1e-6,
                      shared_expert=True)


def synth_wrap(sc, spec: Spec, config: dict) -> SynthWrap:
    """A synthetic text-only checkpoint holds the hub's mtp head after the model."""
    return SynthWrap({**config, "mtp_num_hidden_layers": 1}, extra=mtp_tensors(sc, spec))


__all__ = ["EXPERT_PROJ", "GGUF", "INTERMEDIATE_KEY", "MLX_MOE", "MLX_VALUES", "MOE_PREFIXES", "ROUTER", "ModelArgs",
           "expert_layer", "layer_tensors", "layers", "synth_config", "synth_expert_nbytes", "synth_experts"]
