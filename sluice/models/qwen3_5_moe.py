"""Qwen3.5 / Qwen3.6 MoE (`model_type: qwen3_5_moe`: Qwen3.6-35B-A3B, Qwen3.5-122B-A10B, Qwen3.5-397B-A17B):
Qwen3-Next's hybrid design (models/qwen3_next.py: three Gated DeltaNet layers to one gated full-attention layer,
zero-centred norms, a quarter of each head rotary) with Qwen3.5's four separate linear-attention input projections
(`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`), every layer sparse (a softmax top-k router whose weights are
always renormalised, a shared expert scaled by sigmoid(shared_expert_gate)).

The hub ships these models as the multimodal wrapper (`Qwen3_5MoeForConditionalGeneration`): config.json nests the
text model's config under `text_config`, its tensors live under `model.language_model.*` beside a vision tower
(`model.visual.*`) and a multi-token-prediction head (`mtp.*`); checkpoint/multimodal.py presents the text model and
nothing reads the rest. Rope: the config's multimodal rope (`mrope_section`, interleaved) gives a text token the same
position on its three axes, which is the plain rope of that position. The text-only layout
(`Qwen3_5MoeForCausalLM`, `model.layers.*`) says `model_type: qwen3_5_moe_text` (qwen3_5_moe_text.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..checkpoint.multimodal import TEXT_PREFIX
from .arch import GGUFArch, SynthDefaults, SynthWrap, TensorName
from .qwen3_next import (CENTRED_NORMS, GGUF_HYBRID, GGUF_HYBRID_VALUES, HybridArgs, hybrid_gguf_config,
                         hybrid_synth_config, mtp_tensors)
from .qwen3_next import layers as layers  # the same composition: gated attention or Gated DeltaNet, then the MoE
from .qwen3_next import layer_tensors as layer_tensors  # the projections the Spec says (Qwen3.5's four)
from .spec import Spec

MODEL_TYPE = "qwen3_5_moe"
MOE_PREFIXES = ("mlp",)
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")
ROUTER = "gate"  # the router is `{prefix}.gate.weight` (store/layout.py moe_prefix)
MLX_MOE = "mlp"  # mlx-lm's name of the MoE block (tools/mlx_export.py)
MLX_VALUES = CENTRED_NORMS  # mlx-lm's sanitize stores the zero-centred norms as 1 + w (qwen3_next.py)
synth_experts = synth_expert_nbytes = None  # make-model writes the per-expert / fused layouts
expert_layer = None  # store/layout.py reads the per-expert, fused or stacked expert layouts
INTERMEDIATE_KEY = "moe_intermediate_size"
# the hub config's token ids of the vision markers (Qwen3.5 / 3.6's vocabulary)
VISION_TOKENS = dict(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
                     vision_end_token_id=248054)


@dataclass(kw_only=True)
class ModelArgs(HybridArgs):
    """Every layer sparse; norm_topk_prob, decoder_sparse_step, mlp_only_layers and intermediate_size are not read
    (transformers' Qwen3.5 MoE has no dense layer and always renormalises the top-k weights)."""

    def spec(self) -> Spec:
        return self.hybrid_spec(norm_topk_prob=True)


# -- synthetic checkpoints (tools/synth.py) --------------------------------------------------------------------------
# Qwen3.6-35B-A3B: 40 layers (every 4th full attention), hidden 2048, 16 heads of 256 (2 kv), linear attention 16 key
# / 32 value heads of 128, 256 experts top-8 of 512 plus a shared expert of 512, rope theta 1e7: `make-model --arch
# qwen3_5_moe --layers 40 --hidden 2048 --heads 16 --kv-heads 2 --head-dim 256` with the experts left to the size.
SYNTH = SynthDefaults("Qwen3_5MoeForConditionalGeneration", num_experts=256, top_k=8, rope_theta=1e7,
                      rms_norm_eps=1e-6, shared_expert=True)


def synth_config(sc) -> dict[str, Any]:
    """config.json keys of a synthetic Qwen3.5 MoE text model (models/qwen3_next.py hybrid_synth_config)."""
    return hybrid_synth_config(sc)


def vision_tower(hidden: int, out: int, depth: int = 2, patch: int = 16, temporal: int = 2, merge: int = 2,
                 positions: int = 64) -> tuple[dict, list[TensorName]]:
    """(vision_config, its tensors under model.visual.*) of a Qwen3.5 vision tower of `depth` blocks of width
    `hidden` whose merger outputs `out` (the text model's hidden size). The real one has 27 blocks of 1152 (~0.45B
    parameters); a synthetic checkpoint writes two narrow blocks: the layout, bytes a text run never reads."""
    v, inter, cat = "model.visual", 2 * hidden, hidden * merge * merge
    config = dict(model_type="qwen3_5_moe_vision", depth=depth, hidden_size=hidden, intermediate_size=inter,
                  num_heads=max(1, hidden // 32), in_channels=3, patch_size=patch, temporal_patch_size=temporal,
                  spatial_merge_size=merge, out_hidden_size=out, num_position_embeddings=positions,
                  hidden_act="gelu_pytorch_tanh")
    t = [TensorName("visual", f"{v}.patch_embed.proj.weight", (hidden, 3, temporal, patch, patch), "proj"),
         TensorName("visual", f"{v}.patch_embed.proj.bias", (hidden,), "bias"),
         TensorName("visual", f"{v}.pos_embed.weight", (positions, hidden), "proj")]
    for i in range(depth):
        b = f"{v}.blocks.{i}"
        for name, shape in ((f"{b}.norm1", (hidden,)), (f"{b}.norm2", (hidden,))):
            t += [TensorName("visual", f"{name}.weight", shape, "norm"), TensorName("visual", f"{name}.bias", shape,
                                                                                    "bias")]
        for name, rows, cols in (("attn.qkv", 3 * hidden, hidden), ("attn.proj", hidden, hidden),
                                 ("mlp.linear_fc1", inter, hidden), ("mlp.linear_fc2", hidden, inter)):
            t += [TensorName("visual", f"{b}.{name}.weight", (rows, cols), "proj"),
                  TensorName("visual", f"{b}.{name}.bias", (rows,), "bias")]
    t += [TensorName("visual", f"{v}.merger.norm.weight", (hidden,), "norm"),
          TensorName("visual", f"{v}.merger.norm.bias", (hidden,), "bias"),
          TensorName("visual", f"{v}.merger.linear_fc1.weight", (cat, cat), "proj"),
          TensorName("visual", f"{v}.merger.linear_fc1.bias", (cat,), "bias"),
          TensorName("visual", f"{v}.merger.linear_fc2.weight", (out, cat), "proj"),
          TensorName("visual", f"{v}.merger.linear_fc2.bias", (out,), "bias")]
    return config, t


def synth_wrap(sc, spec: Spec, config: dict) -> SynthWrap:
    """The hub's multimodal wrapper: the text config under text_config (model_type qwen3_5_moe_text), a vision
    tower, the text model under model.language_model.*, then the vision tower and the mtp head."""
    meta = ("architectures", "torch_dtype", "dtype")
    text = {k: v for k, v in config.items() if k not in meta}
    text.update(model_type="qwen3_5_moe_text", mtp_num_hidden_layers=1)
    vision, visual = vision_tower(64, spec.hidden_size)
    wrapped = {"architectures": [SYNTH.hf_class], "model_type": MODEL_TYPE, "text_config": text,
               "vision_config": vision, "tie_word_embeddings": config["tie_word_embeddings"], **VISION_TOKENS,
               **{k: config[k] for k in meta[1:]}}
    return SynthWrap(wrapped, prefix=TEXT_PREFIX, extra=[*visual, *mtp_tensors(sc, spec)])


# -- GGUF (checkpoint/gguf_config.py) --------------------------------------------------------------------------------
# llama.cpp's qwen35moe: qwen3_next.py's facts, Qwen3.5's four projections (in_proj_b, in_proj_a as ssm_beta,
# ssm_alpha), and the value heads stored tiled over the key heads (its converter's reorder, so that ggml broadcasts
# the key heads: models/layers/gated_deltanet.py runs them so). rope.dimension_sections (the multimodal rope's split)
# is not read: a text token has one position on all three axes, the plain rope of it.
def _gguf_config(m, tensors) -> dict[str, Any]:
    return {**hybrid_gguf_config(m, tensors), "linear_value_head_order": "tiled"}


GGUF = GGUFArch("qwen35moe", tensors={**GGUF_HYBRID, "ssm_beta.weight": "linear_attn.in_proj_b.weight",
                                      "ssm_alpha.weight": "linear_attn.in_proj_a.weight"},
                config=_gguf_config, norm_topk_prob=True, values=GGUF_HYBRID_VALUES, partial_rope=True)
