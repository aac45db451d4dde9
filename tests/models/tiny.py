"""Tiny random checkpoints of each architecture, written by transformers itself (the oracle) in both layouts."""

from __future__ import annotations

from pathlib import Path

import torch

# hidden 64, 2-3 layers, 4-8 experts; each config exercises the fields that change the math for its family. Keys
# name the case, `model_type` the architecture (glm4_moe has two cases).
TINY: dict[str, dict] = {
    "qwen3_moe": dict(
        model_type="qwen3_moe", vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24,  # head_dim distinct from hidden/heads; GQA 2:1
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=48,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],  # one dense layer
        rms_norm_eps=1e-6, rope_theta=50000.0, max_position_embeddings=256,
        tie_word_embeddings=False,
    ),
    "mixtral": dict(
        model_type="mixtral", vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, intermediate_size=40,
        rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=256, sliding_window=8,
    ),
    "olmoe": dict(
        model_type="olmoe", vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_experts=8, num_experts_per_tok=3, intermediate_size=32,
        norm_topk_prob=False, clip_qkv=0.5, rms_norm_eps=1e-5, max_position_embeddings=256,
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe", vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, intermediate_size=56, decoder_sparse_step=1, mlp_only_layers=[2],
        qkv_bias=True, norm_topk_prob=False, max_position_embeddings=256,
        use_sliding_window=True, sliding_window=8, max_window_layers=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                         "original_max_position_embeddings": 128},
        tie_word_embeddings=True,
    ),
    "gpt_oss": dict(
        model_type="gpt_oss", vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32,  # head_dim distinct from hidden/heads; MXFP4 rows: H, I multiples of 32
        num_local_experts=6, num_experts_per_tok=2, intermediate_size=32,
        sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        swiglu_limit=0.5,  # low enough that both clamps bite on these random weights
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
        rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False,
    ),
    # GLM-4.5-Air's shape with the router made to matter: 4 groups of 2 experts, the 2 best groups selectable
    # (grouped top-k excludes experts), a random e_score_correction_bias (hf_model), one dense first layer, a
    # shared expert, partial rotary (12 of 24 dims), q/k/v biases
    "glm4_moe": dict(
        model_type="glm4_moe", vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
        intermediate_size=48, first_k_dense_replace=1, n_shared_experts=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=False, attention_bias=True,
        partial_rotary_factor=0.5, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=256,
    ),
    # GLM-4.5's variant: per-head q/k norm, no attention bias, two shared experts, unnormalised top-k weights,
    # rope_parameters spelling with a quarter of the dims rotary
    "glm4_moe_qknorm": dict(
        model_type="glm4_moe", vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
        intermediate_size=40, first_k_dense_replace=1, n_shared_experts=2, n_group=3, topk_group=1,
        routed_scaling_factor=1.5, norm_topk_prob=False, use_qk_norm=True, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=256,
    ),
    # latent attention with a low-rank q; grouped sigmoid routing that excludes groups (2 of 4 selectable) with
    # non-zero e_score_correction_bias (hf_model); one dense first layer; a shared expert; yarn rope whose
    # mscale_all_dim scales the softmax; interleaved rope
    "deepseek_v3": dict(
        model_type="deepseek_v3", vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        intermediate_size=48, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12,
        qk_rope_head_dim=8, v_head_dim=10, rope_interleave=True, rms_norm_eps=1e-6, max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 0.7},
    ),
    # the other branches: q_proj (no q lora), rope on halves, attention biases, two shared experts, no grouping
    "deepseek_v3-q_proj": dict(
        model_type="deepseek_v3", vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
        intermediate_size=40, n_shared_experts=2, first_k_dense_replace=1, n_group=1, topk_group=1,
        routed_scaling_factor=1.5, norm_topk_prob=False, q_lora_rank=None, kv_lora_rank=20, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=12, rope_interleave=False, attention_bias=True, rms_norm_eps=1e-5,
        rope_theta=50000.0, max_position_embeddings=256,
    ),
    # Gated DeltaNet hybrids (three linear layers to one gated attention layer): two value heads per key head, key
    # and value head dims distinct, a dense layer (mlp_only_layers), a shared expert with its sigmoid gate, half of
    # each head rotary (top-level partial_rotary_factor), top-k weights not renormalised
    "qwen3_next": dict(
        model_type="qwen3_next", vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=24, shared_expert_intermediate_size=32, intermediate_size=40, mlp_only_layers=[2],
        norm_topk_prob=False, partial_rotary_factor=0.5, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=512,
    ),
    # the hub's Qwen3.5 / 3.6 layout: the multimodal wrapper (text_config, model.language_model.*, a vision tower);
    # attention every 2nd layer, the default quarter of each head rotary, the multimodal rope's keys
    "qwen3_5_moe": dict(
        model_type="qwen3_5_moe",
        text_config=dict(
            vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
            linear_value_head_dim=8, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16,
            shared_expert_intermediate_size=24, full_attention_interval=2, rms_norm_eps=1e-6,
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "mrope_section": [2, 1, 1],
                             "mrope_interleaved": True},
        ),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           num_position_embeddings=16),
    ),
    # the text-only layout (Qwen3_5MoeForCausalLM's save_pretrained: model_type qwen3_5_moe_text, model.layers.*)
    "qwen3_5_moe_text": dict(
        model_type="qwen3_5_moe_text", vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                          "linear_attention"],
        rope_theta=5e6, max_position_embeddings=512,
    ),
    # Qwen4-Exp (the hub's multimodal wrapper): 3 residual streams (hyper-connections), PLE on both Gated DeltaNet
    # layers (2 heads per n-gram order, trigrams: 4 heads of 8; prime parts from 101, tables split in 3 shards),
    # QSA on the attending ones (blocks of 4, a 16-token budget: prompts past ~20 tokens drop keys), the sigmoid
    # output gate, half of each head rotary; end-of-sequence 5 (tests put it inside prompts)
    "qwen4_exp": dict(
        model_type="qwen4_exp",
        text_config=dict(
            vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=12, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
            shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                             "full_attention"],
            hc_count=3, hc_lowrank=12, output_gate_type="sigmoid", ple_layer_ids=[1, 3], ple_embed_dim=32,
            ple_conv_kernel_size=3, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=101,
            make_ngram_vocab_size_divisible_by=16, seed=7, split_ngram_parts=3, indexer_n_heads=4,
            indexer_kv_heads=1, indexer_head_dim=12, indexer_budget=16, indexer_compress_ratio=4, eos_token_id=5,
            rms_norm_eps=1e-6, max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        ),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           num_position_embeddings=16),
    ),
}
# the zero-centred norms (scale 1 + weight) of the families that have them: drawn around 0
CENTRED = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight", "hc_norm.weight",
           "norm_key.weight", "norm_query.weight", "norm_conv.weight")


def hf_model(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A transformers model of the tiny config (with `overrides`) with random weights (scaled up so routing and
    logits spread) and random router selection biases."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from transformers import AutoModelForImageTextToText

    cfg = {**TINY[arch], **overrides}
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    # a multimodal wrapper (text_config) as the hub ships it: its *ForConditionalGeneration
    auto = AutoModelForImageTextToText if "text_config" in cfg else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    # the hybrids' RMSNorms scale by 1 + weight (zero-centred): their weights are drawn around 0 (all but the Gated
    # DeltaNet's output norm, linear_attn.norm, and the vision tower's LayerNorms)
    centred = type(model).__name__.startswith(("Qwen3Next", "Qwen3_5Moe", "Qwen4Exp"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if centred and name.endswith(CENTRED):
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # selection-only router bias: zero unless set
                b.normal_(0.0, 0.1)
    return model.to(dtype).eval()


def write_checkpoint(model, out: Path, layout: str) -> Path:
    """save_pretrained in the hub's per-expert layout (the default) or transformers' fused layout."""
    if layout == "fused":
        model.save_pretrained(out, save_original_format=False)
    else:
        model.save_pretrained(out)
    return out


def q8_qwen35_gguf(root: Path, num_experts: int) -> Path:
    """A tiny qwen3_5_moe (Gated DeltaNet and gated attention layers, a shared expert of the routed experts' shape,
    top 2 of `num_experts`) written by sluice's own quantizer in Q8_0 under `root`: no llama.cpp needed."""
    from sluice.tools.quantize import quantize
    from sluice.tools.synth import SynthConfig, make_model

    sc = SynthConfig(arch="qwen3_5_moe", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                     num_experts=num_experts, top_k=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                     vocab_size=300)
    out = root / "m.gguf"
    quantize(make_model(root / "m", sc, progress=False), out, "q8_0")
    return out
