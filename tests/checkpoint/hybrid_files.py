"""Tiny Gated DeltaNet hybrids (qwen3_next, qwen3_5_moe in the hub's wrapper) in shapes llama.cpp runs, saved by
transformers with a trained tokenizer: the checkpoints the GGUF tests convert (llama.cpp's converter, sluice's
export-gguf) and read back.

llama.cpp's graphs take one head size for the keys and values of the linear attention (ssm.state_size), have no
dense layer and always renormalise the top-k weights; its K-quants need rows of whole 256-value blocks (else the
quantizer keeps the tensor in another type), hence the 256-wide K_SHAPES."""

from __future__ import annotations

import torch

from sluice.tools.tokenizer_train import train_tokenizer
from tests.models.tiny import TINY, hf_model, write_checkpoint

GGUF_ARCH = {"qwen3_next": "qwen3next", "qwen3_5_moe": "qwen35moe"}
# the tiny configs (tests/models/tiny.py) as llama.cpp can run them
LLAMA_TINY = {
    "qwen3_next": dict(linear_value_head_dim=8, mlp_only_layers=[], norm_topk_prob=True),
    "qwen3_5_moe": dict(text_config={**TINY["qwen3_5_moe"]["text_config"], "linear_value_head_dim": 16}),
}
# every row a whole number of 256-value blocks: hidden, the experts' and the shared expert's intermediate, the
# attention's and the linear attention's output widths
K_TEXT = dict(vocab_size=300, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
              linear_value_head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
              shared_expert_intermediate_size=256, rms_norm_eps=1e-6, max_position_embeddings=512)
K_SHAPES = {
    "qwen3_next": dict(K_TEXT, mlp_only_layers=[], norm_topk_prob=True, full_attention_interval=2,
                       partial_rotary_factor=0.25, intermediate_size=256),
    "qwen3_5_moe": dict(text_config={**TINY["qwen3_5_moe"]["text_config"], **K_TEXT,
                                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                                         "mrope_section": [4, 2, 2], "mrope_interleaved": True}},
                        vision_config={**TINY["qwen3_5_moe"]["vision_config"], "out_hidden_size": 256}),
}
LONG = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(31)).tolist()  # > two 64-token blocks
SHORT = LONG[:24]


def hf_folder(arch: str, root, **overrides):
    """(a tiny random `arch` checkpoint saved by transformers with a trained tokenizer, the model)."""
    model = hf_model(arch, **overrides)
    # tests/models/tiny.py draws projections at std 0.1, a gain of about 1 at hidden 64; at 256 that doubles per
    # layer and the logits turn chaotic (Q8_0's rounding alone moved them by 25%, relative L2): scaled to the width
    hidden = model.config.get_text_config().hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name and "visual" not in name:
                p.mul_((64 / hidden) ** 0.75)
    folder = write_checkpoint(model, root / "hf", "per_expert")
    train_tokenizer(folder, vocab_size=280)  # the converters read one; ids are all these tests use
    return folder, model


def tiled(t: torch.Tensor, dim: int, k_heads: int, width: int) -> torch.Tensor:
    """`t` with its value heads (`width` values each along `dim`) moved from grouped by key head (transformers') to
    tiled order (llama.cpp's qwen35 converter's): value head m of key head g to place m * k_heads + g."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], k_heads, shape[dim] // (k_heads * width), width, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def tiled_state_dict(sd: dict[str, torch.Tensor], k_heads: int, key_dim: int, v_head_dim: int
                     ) -> dict[str, torch.Tensor]:
    """A Qwen3.5 state dict with every value-head tensor of its linear attention in tiled order, built here from the
    layer's definition (not from sluice's code): v rows of in_proj_qkv and of the conv, in_proj_z, _b, _a, A_log,
    dt_bias, out_proj's columns."""
    out = {}
    for name, t in sd.items():
        leaf = name.rpartition(".linear_attn.")[2] if ".linear_attn." in name else ""
        if leaf in ("in_proj_qkv.weight", "conv1d.weight"):
            t = torch.cat([t[:2 * key_dim], tiled(t[2 * key_dim:], 0, k_heads, v_head_dim)])
        elif leaf == "in_proj_z.weight":
            t = tiled(t, 0, k_heads, v_head_dim)
        elif leaf in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
            t = tiled(t, 0, k_heads, 1)
        elif leaf == "out_proj.weight":
            t = tiled(t, 1, k_heads, v_head_dim)
        out[name] = t.contiguous()
    return out


def assert_native_deltanet(m, tiled: bool) -> None:
    """Every Gated DeltaNet layer of the loaded model m runs its decode tokens on the native step (native/deltanet.py),
    pairing q / k with the value heads in `tiled` order (llama.cpp's qwen35moe) or grouped (transformers')."""
    from sluice.models.layers.gated_deltanet import GatedDeltaNet

    mixers = [layer.mixer for layer in m.model.layers if isinstance(layer.mixer, GatedDeltaNet)]
    assert mixers and all(x.tiled == tiled for x in mixers), (len(mixers), tiled)
    assert all(x.native is not None and x.native.owner.tiled == tiled for x in mixers), "the torch steps decode"
