"""The Gated DeltaNet hybrids (qwen3_next -> qwen3next, qwen3_5_moe -> qwen35moe) in llama.cpp's layout, for
tools/gguf_export.py: what convert_hf_to_gguf.py does to them (read to learn it; nothing is copied), so that
llama.cpp runs the exported file and sluice reads it back through the same GGUF facts (models/qwen3_next.py).

    each resident tensor of a layer       blk.N.<the GGUF facts' name>    values mapped as the facts say (norms but
                                                                          the gated one stored as 1 + w, A_log as
                                                                          -exp(A_log)), the conv squeezed to
                                                                          [C, K] and kept F32
    linear_attn.in_proj_qkvz (qwen3_next) blk.N.attn_qkv, blk.N.attn_gate q | k | v and z, each head group's rows
                                                                          ungrouped (its converter's split)
    value-head tensors (qwen3_5_moe)      in tiled order                  v rows of in_proj_qkv and of the conv,
                                                                          in_proj_z, _b, _a, A_log, dt_bias, and
                                                                          out_proj's columns: value head j of key
                                                                          head g moves to j * nK + g (its reorder)
    metadata                              ssm.{conv_kernel, state_size, group_count, time_step_rank, inner_size},
                                          attention.recurrent_layers, full_attention_interval, rope.dimension_count
                                          (the rotary part), rope.dimension_sections (qwen35moe: required by its
                                          loader; the text rope ignores it)

llama.cpp's graphs take one head size for the keys and values of the linear attention and have no dense layer;
checkpoints that differ are refused (ExportError, tools/gguf_export.py export_args).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from ..checkpoint.gguf_arch import GGUFArch
from ..checkpoint.index import CheckpointIndex
from ..models.spec import Spec
from .gguf_layouts import table_tensors
from .gguf_types import GgufTensor

HYBRID_ARCHS = ("qwen3next", "qwen35moe")
TILED = ("qwen35moe",)  # its converter stores the value heads tiled over the key heads
#: the multimodal rope's split llama.cpp's qwen35moe loader requires, when the config gives none (its converter's)
DEFAULT_SECTIONS = [11, 11, 10, 0]


def hybrid_problem(spec: Spec) -> str | None:
    """Why llama.cpp's graph cannot run this hybrid checkpoint, or None."""
    d = spec.delta
    if d.k_head_dim != d.v_head_dim:
        return (f"config.json linear_key_head_dim {d.k_head_dim} differs from linear_value_head_dim {d.v_head_dim}: "
                "llama.cpp's graph takes one head size for both (ssm.state_size)")
    return None


def _tiled(t: torch.Tensor, dim: int, k_heads: int, width: int) -> torch.Tensor:
    """`t` with its value heads (`width` values each along `dim`) moved from grouped by key head to tiled order."""
    shape = list(t.shape)
    groups = t.reshape(*shape[:dim], k_heads, shape[dim] // (k_heads * width), width, *shape[dim + 1:])
    return groups.transpose(dim, dim + 1).reshape(shape)


def _v_part(t: torch.Tensor, key_dim: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`fn` applied to the rows after q | k (the value rows of in_proj_qkv and of the conv)."""
    return torch.cat([t[: 2 * key_dim], fn(t[2 * key_dim:])])


def _reorder(role: str, spec: Spec, layer: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The grouped -> tiled reorder of a value-head tensor of role `role` in a Gated DeltaNet layer, or None."""
    d = spec.delta
    nk, dv = d.n_k_heads, d.v_head_dim
    if not d.layers[layer] or d.n_v_heads == nk:
        return None
    if role in ("delta.qkv", "delta.conv"):
        return lambda t: _v_part(t, d.key_dim, lambda v: _tiled(v, 0, nk, dv))
    if role == "delta.z":
        return lambda t: _tiled(t, 0, nk, dv)
    if role in ("delta.b", "delta.a", "delta.A_log", "delta.dt_bias"):
        return lambda t: _tiled(t, 0, nk, 1)
    if role == "o":
        return lambda t: _tiled(t, 1, nk, dv)
    return None


def _split_qkvz(spec: Spec, index: CheckpointIndex, name: str, g: str) -> list[GgufTensor]:
    """Qwen3-Next's in_proj_qkvz (rows per key head: q, k, its value heads' v, their z) as llama.cpp's attn_qkv
    (q | k | v of all heads) and attn_gate (z)."""
    d, ref = spec.delta, index[name]
    H, vr = spec.hidden_size, d.value_dim // d.n_k_heads

    def part(t: torch.Tensor, which: str) -> torch.Tensor:
        q, k, v, z = t.view(d.n_k_heads, -1, H).split([d.k_head_dim, d.k_head_dim, vr, vr], dim=1)
        return z.reshape(-1, H) if which == "z" else torch.cat([x.reshape(-1, H) for x in (q, k, v)])

    return [GgufTensor(f"{g}.attn_qkv.weight", (d.conv_dim, H), (ref,), transform=lambda t: part(t, "qkv")),
            GgufTensor(f"{g}.attn_gate.weight", (d.value_dim, H), (ref,), transform=lambda t: part(t, "z"))]


def hybrid_tensors(index: CheckpointIndex, spec: Spec, facts: GGUFArch, arch: ModuleType,
                   experts: Callable[[str, str], list[GgufTensor]]) -> list[GgufTensor]:
    """Every GGUF tensor of a hybrid in file order (nothing is read); `experts(moe prefix, blk.N)` gives a layer's
    expert stacks (tools/gguf_export.py's, the other architectures' own)."""
    reorder = (lambda role, L: _reorder(role, spec, L)) if facts.name in TILED else None
    split = lambda index, name, g: _split_qkvz(spec, index, name, g)  # noqa: E731
    return table_tensors(index, spec, facts, arch, experts, {"delta.qkvz": split}, reorder)


def hybrid_hparams(w, arch: str, spec: Spec, config: dict) -> None:
    """The hybrids' own `{arch}.*` keys (the common ones are tools/gguf_export.py's)."""
    d = spec.delta
    if config.get("intermediate_size"):
        w.add_feed_forward_length(config["intermediate_size"])
    w.add_expert_feed_forward_length(spec.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(spec.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(d.conv_kernel)
    w.add_ssm_state_size(d.k_head_dim)
    w.add_ssm_group_count(d.n_k_heads)
    w.add_ssm_time_step_rank(d.n_v_heads)
    w.add_ssm_inner_size(d.value_dim)
    w.add_array(f"{arch}.attention.recurrent_layers", [bool(x) for x in d.layers])  # (gguf 0.19 has no adder)
    # the config's (its converter writes it, default 4); recurrent_layers above is what llama.cpp's loader reads
    w.add_full_attention_interval(config.get("full_attention_interval") or 4)
    w.add_rope_dimension_count(int(spec.head_dim * spec.rope.partial_rotary_factor))
    if arch == "qwen35moe":
        rope = config.get("rope_parameters") or {}
        sections = list(rope.get("mrope_section") or config.get("mrope_section") or DEFAULT_SECTIONS)
        w.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])
