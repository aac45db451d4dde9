"""Tiny gpt_oss, glm4_moe and deepseek_v3 checkpoints saved by transformers with a trained tokenizer, in configs
llama.cpp's graphs compute as transformers does: the checkpoints the GGUF layout tests convert (llama.cpp's converter,
sluice's export-gguf) and read back.

What the configs change from tests/models/tiny.py, and why:
- gpt_oss: llama.cpp's graph hard-codes the SwiGLU clamp at 7 (swiglu_limit) and truncates YaRN's correction
  range (rope truncate true);
- deepseek_v3: the hub's `scoring_func: sigmoid` (transformers does not save it; without it llama.cpp's converter
  writes no gating function and the file routes by softmax), YaRN's mscale equal to mscale_all_dim (the converter
  stores the latter only, llama.cpp takes both equal); the q_proj case rotates interleaved pairs (llama.cpp's
  deepseek2 rope is interleaved whatever the checkpoint says).
The q_proj case (no q lora) is one llama.cpp does not load (its deepseek2 loader requires q_lora_rank unless the
model has 26 or 27 layers), nor does it run attention biases: it is checked against transformers only (LLAMA_RUNS).
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from sluice.models import get_arch
from sluice.tools.tokenizer_train import train_tokenizer
from tests.models.tiny import TINY, hf_model, write_checkpoint

GGUF_ARCH = {"gpt_oss": "gpt-oss", "glm4_moe": "glm4moe", "glm4_moe_qknorm": "glm4moe", "deepseek_v3": "deepseek2",
             "deepseek_v3-q_proj": "deepseek2"}
_DS_ROPE = {**TINY["deepseek_v3"]["rope_parameters"], "mscale": 0.7, "mscale_all_dim": 0.7}
LLAMA_TINY = {
    "gpt_oss": dict(swiglu_limit=7.0, rope_parameters={**TINY["gpt_oss"]["rope_parameters"], "truncate": True}),
    "glm4_moe": {},
    "glm4_moe_qknorm": {},
    "deepseek_v3": dict(scoring_func="sigmoid", rope_parameters=_DS_ROPE),
    "deepseek_v3-q_proj": dict(scoring_func="sigmoid", rope_interleave=True),
}
LLAMA_RUNS = ("gpt_oss", "glm4_moe", "glm4_moe_qknorm", "deepseek_v3")
# every row a whole number of Q8_0's 32-value blocks (else the converter keeps the tensor in F16)
Q8_SHAPES = {
    "gpt_oss": dict(LLAMA_TINY["gpt_oss"], intermediate_size=64),
    "glm4_moe": dict(head_dim=32, moe_intermediate_size=32, intermediate_size=64),
    "glm4_moe_qknorm": dict(head_dim=32, moe_intermediate_size=32, intermediate_size=64),
    "deepseek_v3": dict(LLAMA_TINY["deepseek_v3"], q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32,
                        qk_rope_head_dim=16, v_head_dim=32, moe_intermediate_size=32, intermediate_size=64),
}
LONG = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(37)).tolist()
SHORT = LONG[:24]


def hf_folder(case: str, root, **overrides):
    """(the tiny `case` checkpoint saved by transformers with a trained tokenizer holding the family's special
    tokens, the model)."""
    model = hf_model(case, **overrides)
    folder = write_checkpoint(model, root / "hf", "per_expert")
    special = get_arch(TINY[case]["model_type"]).SYNTH.special_tokens
    train_tokenizer(folder, vocab_size=280, special_tokens=special)  # the converters read one; ids are all we use
    return folder, model


def mxfp4_folder(root, **overrides):
    """(a tiny gpt_oss checkpoint with its experts in MXFP4 as shipped, the transformers model holding their
    dequantization) with a trained tokenizer."""
    from tests.models.test_gpt_oss import mxfp4_checkpoint

    folder, model = mxfp4_checkpoint(root / "hf", torch.float32, **{**LLAMA_TINY["gpt_oss"], **overrides})
    train_tokenizer(folder, vocab_size=280)
    return folder, model


def add_nextn_layer(folder) -> None:
    """GLM's multi-token-prediction layer appended as the hub has it (GLM-4.5-Air's model.layers.46): a copy of the
    last decoder layer plus eh_proj, enorm, hnorm and the shared head, num_nextn_predict_layers 1. Nothing runs it."""
    config = json.loads((folder / "config.json").read_text())
    n, H, V = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    state = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    extra = {k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): v.clone()
             for k, v in state.items() if k.startswith(f"model.layers.{n - 1}.")}
    for name, shape in (("eh_proj.weight", (H, 2 * H)), ("enorm.weight", (H,)), ("hnorm.weight", (H,)),
                        ("shared_head.norm.weight", (H,)), ("shared_head.head.weight", (V, H))):
        extra[f"model.layers.{n}.{name}"] = torch.randn(shape, generator=g)
    save_file({**state, **extra}, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
