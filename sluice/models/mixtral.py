"""Mixtral (`model_type: mixtral`): GQA, every layer sparse, top-k weights always renormalised and kept in float32,
optional sliding window on all layers. Hub checkpoints name the block `block_sparse_moe` with experts w1/w3/w2
(gate/up/down); transformers>=5 fused checkpoints use `mlp.experts.gate_up_proj`."""

from __future__ import annotations

from dataclasses import dataclass

from typing import Any

from ..errors import ConfigError
from .arch import GGUF_COMMON, GGUFArch, SynthDefaults
from .arch import layer_tensors as layer_tensors  # the shared layout; no biases, no q/k norm
from .args import BaseArgs, sliding_windows
from .spec import Spec
from .schema import cfg, override
from .layers import Attention, Build, PreNorm, moe_or_dense

MODEL_TYPE = "mixtral"
MOE_PREFIXES = ("block_sparse_moe", "mlp")
EXPERT_PROJ = ("w1", "w3", "w2")
ROUTER = "gate"  # the router is `{prefix}.gate.weight` (store/layout.py moe_prefix)
MLX_MOE = "block_sparse_moe"  # mlx-lm's name of the MoE block (tools/mlx_export.py)
MLX_VALUES: dict[str, str] = {}  # mlx-lm's converter keeps the values
synth_experts = synth_expert_nbytes = None  # make-model writes the per-expert / fused layouts
expert_layer = None  # store/layout.py reads the per-expert, fused or stacked expert layouts
synth_wrap = None  # make-model writes the text model alone
INTERMEDIATE_KEY = "intermediate_size"


@dataclass(kw_only=True)
class ModelArgs(BaseArgs):
    # num_experts: hub configs spell it num_local_experts (BaseArgs takes both)
    intermediate_size: int = cfg(ge=1)  # the experts' intermediate size
    rms_norm_eps: float = override(BaseArgs, "rms_norm_eps", 1e-5)
    max_position_embeddings: int = override(BaseArgs, "max_position_embeddings", 4096 * 32)
    sliding_window: int | None = cfg(None, ge=1)  # null: full attention

    DEFAULT_THETA = 1e6

    def spec(self) -> Spec:
        n = self.num_hidden_layers
        return self.base_spec(
            moe_intermediate_size=self.intermediate_size,
            sliding_window=sliding_windows(n, self.sliding_window),
            norm_topk_prob=True,
            router_weights_fp32=True,
        )


# -- synthetic checkpoints (tools/synth.py) --------------------------------------------------------------------------
# Mixtral-8x7B: 8 experts top-2, intermediate 14336 / hidden 4096.
SYNTH = SynthDefaults("MixtralForCausalLM", num_experts=8, top_k=2, rope_theta=1e6, rms_norm_eps=1e-5)


def synth_config(sc) -> dict[str, Any]:
    """config.json keys of a synthetic mixtral (full attention)."""
    return dict(num_local_experts=sc.num_experts, intermediate_size=sc.moe_intermediate_size, sliding_window=None)


# -- GGUF (checkpoint/gguf_config.py): llama.cpp stores Mixtral as `llama` with experts ------------------------------
def _gguf_accept(m) -> None:
    """A llama GGUF is Mixtral only with experts and without shared ones."""
    if m.int("expert_count", 0, minimum=0) == 0:
        raise ConfigError(f"{m.file}: a llama GGUF without experts (llama.expert_count absent or 0) is a dense model; "
                          "sluice runs mixture-of-experts models (a llama GGUF with experts is Mixtral)")
    if m.int("expert_shared_feed_forward_length", 0, minimum=0):
        raise ConfigError(f"{m.file}: a llama GGUF with shared experts (Granite-MoE) is not supported")


def _gguf_config(m, tensors) -> dict[str, Any]:
    # full attention: llama.cpp's llama graph has no sliding window
    return dict(num_local_experts=m.int("expert_count"), intermediate_size=m.int("feed_forward_length"),
                sliding_window=None)


GGUF = GGUFArch("llama", tensors=dict(GGUF_COMMON), config=_gguf_config, norm_topk_prob=True, rope_permuted=True,
                accept=_gguf_accept)


def layers(b: Build) -> list[PreNorm]:
    """Pre-norm layers of grouped-query attention (sliding windows where the config sets one) and a softmax-routed
    MoE block."""
    return [PreNorm(b, L, Attention(b, L), moe_or_dense(b, L)) for L in range(b.spec.n_layers)]
