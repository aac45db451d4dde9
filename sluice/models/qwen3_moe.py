"""Qwen3-MoE (`model_type: qwen3_moe`): GQA with per-head q/k RMSNorm, softmax top-k router with optional
renormalised weights, optional dense layers (mlp_only_layers / decoder_sparse_step), optional sliding window."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from typing import Any

from .arch import GGUF_COMMON, GGUF_QK_NORM, GGUFArch, SynthDefaults
from .arch import layer_tensors as layer_tensors  # the shared Qwen/Mixtral/OLMoE layer layout
from .args import BaseArgs, moe_layer_flags, sliding_windows
from .spec import Spec
from .schema import cfg, override
from .layers import Attention, Build, PreNorm, moe_or_dense

MODEL_TYPE = "qwen3_moe"
# Checkpoint naming: the MoE block lives under `mlp`; per-expert projections are gate/up/down.
MOE_PREFIXES = ("mlp",)
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")
ROUTER = "gate"  # the router is `{prefix}.gate.weight` (store/layout.py moe_prefix)
MLX_MOE = "mlp"  # mlx-lm's name of the MoE block (tools/mlx_export.py)
MLX_VALUES: dict[str, str] = {}  # mlx-lm's converter keeps the values
synth_experts = synth_expert_nbytes = None  # make-model writes the per-expert / fused layouts
expert_layer = None  # store/layout.py reads the per-expert, fused or stacked expert layouts
synth_wrap = None  # make-model writes the text model alone
INTERMEDIATE_KEY = "moe_intermediate_size"


@dataclass(kw_only=True)
class ModelArgs(BaseArgs):
    moe_intermediate_size: int = cfg(ge=1)
    intermediate_size: int = cfg(0, ge=0)  # dense layers only (required then: see config_problems)
    max_position_embeddings: int = override(BaseArgs, "max_position_embeddings", 32768)
    attention_bias: bool = cfg(False)
    norm_topk_prob: bool = cfg(False)
    decoder_sparse_step: int = cfg(1, ge=1)
    mlp_only_layers: list[int] | None = cfg(None, ge=0, lt="num_hidden_layers")
    use_sliding_window: bool = cfg(False)
    sliding_window: int | None = cfg(4096, ge=0)  # used only with use_sliding_window

    def moe_layers(self) -> list[bool]:
        return moe_layer_flags(self.num_hidden_layers, self.num_experts, self.decoder_sparse_step,
                               self.mlp_only_layers or [])

    def config_problems(self) -> Iterator[tuple[str, str]]:
        yield from super().config_problems()
        yield from dense_and_window_problems(self)

    def spec(self) -> Spec:
        n = self.num_hidden_layers
        return self.base_spec(
            moe_intermediate_size=self.moe_intermediate_size,
            sliding_window=sliding_windows(n, self.sliding_window if self.use_sliding_window else None),
            dense_intermediate_size=self.intermediate_size,
            norm_topk_prob=self.norm_topk_prob,
            qkv_bias=self.attention_bias,
            o_bias=self.attention_bias,
            qk_norm="head",
        )


def dense_and_window_problems(args) -> Iterator[tuple[str, str]]:
    """Qwen-MoE relations: dense layers need intermediate_size; a used sliding window is >= 1."""
    dense = [i for i, sparse in enumerate(args.moe_layers()) if not sparse]
    if dense and args.intermediate_size < 1:
        yield "intermediate_size", (
            f"{'got 0' if 'intermediate_size' in args.config else 'missing'}; layers "
            f"{dense[:8]} are dense (mlp_only_layers / decoder_sparse_step), so their MLP size is needed: expected "
            "an integer >= 1"
        )
    if args.use_sliding_window and args.sliding_window == 0:
        yield "sliding_window", "got 0 while use_sliding_window is true; expected a window >= 1 (or null for none)"


# -- synthetic checkpoints (tools/synth.py) --------------------------------------------------------------------------
# Qwen3-30B-A3B: 128 experts top-8, moe_intermediate 768 / hidden 2048; 64 top-8 here.
SYNTH = SynthDefaults("Qwen3MoeForCausalLM", num_experts=64, top_k=8, rope_theta=1e6, rms_norm_eps=1e-6)


def synth_config(sc) -> dict[str, Any]:
    """config.json keys of a synthetic qwen3_moe: every layer sparse, renormalised top-k, full attention."""
    I = sc.moe_intermediate_size
    return dict(num_experts=sc.num_experts, moe_intermediate_size=I, intermediate_size=4 * I, decoder_sparse_step=1,
                mlp_only_layers=[], norm_topk_prob=True, attention_bias=False, use_sliding_window=False,
                sliding_window=None)


# -- GGUF (checkpoint/gguf_config.py) --------------------------------------------------------------------------------
def qwen_gguf_config(m, tensors) -> dict[str, Any]:
    """The keys llama.cpp's qwen2moe / qwen3moe loaders give: every layer sparse (llama.cpp's graph has no dense
    layers), full attention, the experts' size by llama.cpp's rule (feed_forward_length / top-k when absent)."""
    ff = m.int("feed_forward_length", 0, minimum=0)
    return dict(num_experts=m.int("expert_count"), intermediate_size=ff, decoder_sparse_step=1, mlp_only_layers=[],
                use_sliding_window=False,  # llama.cpp's qwen graphs attend to the whole context
                moe_intermediate_size=m.int("expert_feed_forward_length",
                                            ff // m.int("expert_used_count") or m.REQUIRED))


def _gguf_config(m, tensors) -> dict[str, Any]:
    return {**qwen_gguf_config(m, tensors), "attention_bias": False}  # llama.cpp's qwen3moe has no q/k/v biases


GGUF = GGUFArch("qwen3moe", tensors={**GGUF_COMMON, **GGUF_QK_NORM}, config=_gguf_config, norm_topk_prob=True)


def layers(b: Build) -> list[PreNorm]:
    """Pre-norm layers of grouped-query attention (q / k RMSNorm per head) and a softmax-routed MoE block, or a
    dense MLP on mlp_only_layers."""
    return [PreNorm(b, L, Attention(b, L), moe_or_dense(b, L)) for L in range(b.spec.n_layers)]
