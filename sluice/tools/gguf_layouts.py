"""gpt_oss -> gpt-oss, glm4_moe -> glm4moe and deepseek_v3 -> deepseek2 in llama.cpp's layout, for
tools/gguf_export.py: what convert_hf_to_gguf.py (conversion/gpt_oss.py, glm.py, deepseek.py) writes of them (read to
learn it; nothing is copied), so that llama.cpp runs the exported file and sluice reads it back through the same GGUF
facts (each model file's GGUF). Also the walk every table-driven layout shares (`table_tensors`: these three and the
Gated DeltaNet hybrids, tools/gguf_hybrid.py).

    each resident tensor of a layer         blk.N.<the GGUF facts' name>     as stored (gpt-oss: its sinks, biases,
                                                                             post_attention_norm; glm4moe and deepseek2:
                                                                             a dense first layer's ffn_{gate,up,down},
                                                                             exp_probs_b, the shared experts)
    deepseek_v3 self_attn.kv_b_proj         blk.N.attn_k_b [nH, r, N]        each head's N key rows, transposed
                [nH*(N+V), r]               blk.N.attn_v_b [nH, V, r]        each head's V value rows
    gpt_oss experts.gate_up_proj            blk.N.ffn_{gate,up}_exps         [E, I, H]: transposed, rows 2j (gate)
            [E, H, 2I], .down_proj [E, I, H]   ffn_down_exps [E, H, I]       and 2j + 1 (up) apart; down transposed
            .gate_up_proj_bias [E, 2I]      ffn_{gate,up}_exps.bias [E, I]   likewise apart; down's as is
            MXFP4 *_blocks / *_scales       the same three, GGUF MXFP4        repacked (mxfp4_blocks), kept MXFP4
                                                                             whatever type the rest of the file gets
    metadata (`layout_hparams`)             the keys each converter writes   gpt-oss: sliding_window, yarn;
                                                                             glm4moe: the rotary part, the router's;
                                                                             deepseek2: the latent sizes, llama.cpp's
                                                                             one-head view (head_count_kv 1, key_length
                                                                             r + R, value_length r), yarn's
                                                                             0.1 * mscale_all_dim

Checkpoints whose math these graphs do not compute are refused (`layout_problem`): llama.cpp's gpt-oss hard-codes
the SwiGLU clamp (7, alpha 1.702) and slides on even layers; its deepseek2 rotates interleaved pairs, has no attention
biases, routes by sigmoid and takes YaRN's mscale equal to mscale_all_dim. (Its YaRN also truncates the correction
range whatever rope truncate says; gpt-oss-20b says false: written anyway, as the converter does.)
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from ..checkpoint.gguf_arch import GGUFArch
from ..checkpoint.gguf_index import gguf_name
from ..checkpoint.index import CheckpointIndex
from ..checkpoint.ref import STORED
from ..models.spec import Spec
from ..store.layout import moe_prefix
from .gguf_types import GgufTensor

LAYOUT_ARCHS = ("gpt-oss", "glm4moe", "deepseek2")
# what llama.cpp's gpt-oss graph computes (its LLM_FFN_SWIGLU_OAI_MOE constants)
OAI_SWIGLU = (1.702, 7.0)

Transform = Callable[..., torch.Tensor]
#: (index, config.json-world name, blk.N) -> the GGUF tensors one checkpoint tensor becomes
Split = Callable[[CheckpointIndex, str, str], list[GgufTensor]]


def chain(*fns: Transform | None) -> Transform | None:
    """The transforms applied one after the other (None for none)."""
    fns = tuple(f for f in fns if f is not None)
    if not fns:
        return None

    def run(t: torch.Tensor) -> torch.Tensor:
        for f in fns:
            t = f(t)
        return t

    return run


def _values(facts: GGUFArch, name: str) -> Transform | None:
    how = facts.values_of(name)
    return (lambda t: STORED[how].store(t.float())) if how else None


def table_tensors(index: CheckpointIndex, spec: Spec, facts: GGUFArch, arch: ModuleType,
                  experts: Callable[[str, str], list[GgufTensor]], splits: dict[str, Split] | None = None,
                  reorder: Callable[[str, int], Transform | None] | None = None) -> list[GgufTensor]:
    """Every GGUF tensor in file order (nothing is read), each resident tensor of `arch.layer_tensors` under the
    facts' name with its values mapped as the facts say: `splits` (role -> Split) for the tensors a converter splits,
    `reorder(role, layer)` for rows it moves; `experts(moe prefix, blk.N)` gives a sparse layer's expert tensors."""

    def one(gname: str, hname: str, shape: tuple[int, ...], how: Transform | None = None) -> GgufTensor:
        # read in transformers' shape, reordered, values mapped; the conv written squeezed to [C, K] (the hybrids'
        # converters squeeze it; the shared expert gate keeps its [1, H])
        stored = tuple(x for x in shape if x != 1) if gname.endswith("ssm_conv1d.weight") else tuple(shape)
        return GgufTensor(gname, stored, (index[hname],),
                          transform=chain(lambda x: x.reshape(shape), how, _values(facts, hname)))

    out = [one("token_embd.weight", "model.embed_tokens.weight", index["model.embed_tokens.weight"].shape)]
    for L in range(spec.n_layers):
        g = f"blk.{L}"
        moe = moe_prefix(index, arch, L) if spec.moe_layers[L] else None
        for t in arch.layer_tensors(spec, L, moe):
            if splits and t.role in splits:
                out += splits[t.role](index, t.name, g)
                continue
            out.append(one(gguf_name(t.name, facts), t.name, t.shape, reorder(t.role, L) if reorder else None))
        if moe is not None:
            out += experts(moe, g)
    out.append(one("output_norm.weight", "model.norm.weight", (spec.hidden_size,)))
    if "lm_head.weight" in index and not spec.tie_word_embeddings:
        out.append(one("output.weight", "lm_head.weight", (spec.vocab_size, spec.hidden_size)))
    return out


# -- what llama.cpp's graphs compute ---------------------------------------------------------------------------------
def layout_problem(arch: str, spec: Spec, args) -> str | None:
    """Why llama.cpp's graph for GGUF architecture `arch` cannot run this checkpoint as transformers does, or None."""
    rope = spec.rope
    if arch == "gpt-oss":
        if (spec.swiglu_alpha, spec.swiglu_limit) != OAI_SWIGLU:
            return (f"config.json swiglu_limit {spec.swiglu_limit} (alpha {spec.swiglu_alpha}): llama.cpp's gpt-oss "
                    f"graph clamps at {OAI_SWIGLU[1]} with alpha {OAI_SWIGLU[0]}")
        if not spec.o_bias:
            return "config.json attention_bias is false: llama.cpp's gpt-oss loader requires the q/k/v/o biases"
        if [w is not None for w in spec.sliding_window] != [i % 2 == 0 for i in range(spec.n_layers)]:
            return "config.json layer_types: llama.cpp's gpt-oss graph slides on the even layers and only those"
        return _rope_problem(rope, ("default", "yarn"), ("attention_factor", "mscale", "mscale_all_dim"))
    if arch == "glm4moe":
        return _rope_problem(rope, ("default",), ())
    m = spec.mla  # deepseek2
    if not m.rope_interleave:
        return "config.json rope_interleave is false: llama.cpp's deepseek2 graph rotates interleaved pairs"
    if spec.o_bias:
        return "config.json attention_bias is true: llama.cpp's deepseek2 graph has no attention biases"
    if rope.rope_type == "yarn" and (rope.params.get("mscale_all_dim") is None
                                     or rope.params.get("mscale", 1.0) != rope.params["mscale_all_dim"]):
        return ("config.json rope_parameters: llama.cpp's deepseek2 graph takes YaRN's mscale equal to "
                "mscale_all_dim (and needs the latter)")
    return _rope_problem(rope, ("default", "yarn"), ("attention_factor",))


def _rope_problem(rope, kinds: tuple[str, ...], refused: tuple[str, ...]) -> str | None:
    if rope.rope_type not in kinds:
        return f"config.json rope type {rope.rope_type!r}: supported here: {', '.join(kinds)}"
    bad = [k for k in refused if k in rope.params]
    if bad:
        return f"config.json rope_parameters {', '.join(bad)}: not written by llama.cpp's converter for this model"
    return None


# -- tensors ---------------------------------------------------------------------------------------------------------
def layout_tensors(index: CheckpointIndex, spec: Spec, facts: GGUFArch, arch: ModuleType,
                   stacks: Callable[[str, str], list[GgufTensor]]) -> list[GgufTensor]:
    """Every GGUF tensor of a gpt-oss / glm4moe / deepseek2 export in file order (nothing is read); `stacks(moe
    prefix, blk.N)` gives the gate / up / down stacks of the other architectures' experts (tools/gguf_export.py)."""
    if facts.name == "gpt-oss":
        return table_tensors(index, spec, facts, arch, lambda moe, g: gpt_oss_experts(index, spec, moe, g))
    splits = {"mla.kv_b": _kv_b_split(spec)} if facts.name == "deepseek2" else None
    return table_tensors(index, spec, facts, arch, stacks, splits)


def _kv_b_split(spec: Spec) -> Split:
    """kv_b_proj [nH*(N+V), r] as llama.cpp's converter splits it: attn_k_b [nH, r, N] (each head's key rows,
    transposed) and attn_v_b [nH, V, r]."""
    m, nH = spec.mla, spec.n_heads
    N, V, r = m.qk_nope_head_dim, m.v_head_dim, m.kv_lora_rank

    def split(index: CheckpointIndex, name: str, g: str) -> list[GgufTensor]:
        ref = index[name]
        return [GgufTensor(f"{g}.attn_k_b.weight", (nH, r, N), (ref,),
                           transform=lambda t: t.reshape(nH, N + V, r)[:, :N].transpose(1, 2)),
                GgufTensor(f"{g}.attn_v_b.weight", (nH, V, r), (ref,),
                           transform=lambda t: t.reshape(nH, N + V, r)[:, N:])]

    return split


def mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss MXFP4 (blocks uint8 [..., G, 16]: value 2i in the low nibble of byte i, 2i + 1 in its high one;
    scales [..., G]) -> GGUF's MXFP4 blocks uint8 [..., G * 17]: per group the scale byte, then 16 bytes whose low
    nibbles are values 0-15 and high nibbles 16-31. The codes and the E8M0 scale are the same numbers: bits moved."""
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).flatten(-2)  # [..., G, 32] in value order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat((scales.unsqueeze(-1), qs), dim=-1).flatten(-2)


def gpt_oss_experts(index: CheckpointIndex, spec: Spec, moe: str, g: str) -> list[GgufTensor]:
    """A gpt_oss layer's experts as llama.cpp's converter writes them: gate (rows 2j of gate_up) and up (2j + 1)
    apart, [E, out, in], each with its bias; MXFP4 as shipped repacked into GGUF's MXFP4 blocks, the dequantized
    layout `save_pretrained` writes ([E, in, out]) transposed."""
    x, E, H, I = f"{moe}.experts", spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    out = []
    if f"{x}.gate_up_proj_blocks" in index:
        for name, rows, shape in (("gate", slice(0, None, 2), (E, I, H)), ("up", slice(1, None, 2), (E, I, H)),
                                  ("down", slice(None), (E, H, I))):
            src = "down_proj" if name == "down" else "gate_up_proj"
            out.append(GgufTensor(f"{g}.ffn_{name}_exps.weight", shape,
                                  (index[f"{x}.{src}_blocks"], index[f"{x}.{src}_scales"]),
                                  transform=lambda b, s, rows=rows: mxfp4_blocks(b[:, rows], s[:, rows]),
                                  raw_type="MXFP4"))
    else:
        gu, dn = index[f"{x}.gate_up_proj"], index[f"{x}.down_proj"]
        out += [GgufTensor(f"{g}.ffn_{name}_exps.weight", (E, I, H), (gu,),
                           transform=lambda t, k=k: t.transpose(-1, -2)[:, k::2])
                for k, name in ((0, "gate"), (1, "up"))]
        out.append(GgufTensor(f"{g}.ffn_down_exps.weight", (E, H, I), (dn,), transform=lambda t: t.transpose(-1, -2)))
    bias = index[f"{x}.gate_up_proj_bias"]
    out += [GgufTensor(f"{g}.ffn_{name}_exps.bias", (E, I), (bias,), transform=lambda t, k=k: t[:, k::2])
            for k, name in ((0, "gate"), (1, "up"))]
    out.append(GgufTensor(f"{g}.ffn_down_exps.bias", (E, H), (index[f"{x}.down_proj_bias"],)))
    return out


# -- metadata --------------------------------------------------------------------------------------------------------
def layout_hparams(w, arch: str, spec: Spec, config: dict) -> None:
    """The `{arch}.*` keys llama.cpp's converter writes for a gpt-oss / glm4moe / deepseek2 checkpoint (what the
    architectures' GGUF config hooks read back)."""
    import gguf

    w.add_block_count(spec.n_layers)
    w.add_context_length(spec.rope.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size)
    if config.get("intermediate_size"):
        w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(spec.n_heads)
    w.add_rope_freq_base(spec.rope.theta)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_expert_count(spec.num_experts)
    w.add_expert_used_count(spec.top_k)
    w.add_expert_feed_forward_length(spec.moe_intermediate_size)
    rope = spec.rope
    if rope.rope_type == "yarn":
        p = rope.params
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        orig = p.get("original_max_position_embeddings", rope.max_position_embeddings)
        w.add_rope_scaling_factor(p.get("factor") or rope.max_position_embeddings / orig)
        w.add_rope_scaling_orig_ctx_len(orig)
        if "beta_fast" in p:
            w.add_rope_scaling_yarn_beta_fast(p["beta_fast"])
        if "beta_slow" in p:
            w.add_rope_scaling_yarn_beta_slow(p["beta_slow"])
    if arch == "gpt-oss":
        w.add_head_count_kv(spec.n_kv_heads)
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
        w.add_sliding_window(next(x for x in spec.sliding_window if x is not None))
        return
    w.add_expert_group_count(spec.n_group)
    w.add_expert_group_used_count(spec.topk_group)
    w.add_expert_shared_count(spec.shared_expert_intermediate_size // spec.moe_intermediate_size)
    w.add_leading_dense_block_count(spec.moe_layers.index(True))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(spec.routed_scaling_factor)
    if arch == "glm4moe":
        w.add_head_count_kv(spec.n_kv_heads)
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
        w.add_rope_dimension_count(int(spec.head_dim * rope.partial_rotary_factor))
        w.add_expert_weights_norm(spec.norm_topk_prob)
        return
    m = spec.mla  # deepseek2: llama.cpp's one-head view of the latent, then the latent's own sizes
    w.add_head_count_kv(1)
    w.add_key_length(m.kv_lora_rank + m.qk_rope_head_dim)
    w.add_value_length(m.kv_lora_rank)
    w.add_vocab_size(spec.vocab_size)
    if m.q_lora_rank:
        w.add_q_lora_rank(m.q_lora_rank)
    w.add_kv_lora_rank(m.kv_lora_rank)
    w.add_key_length_mla(m.qk_head_dim)
    w.add_value_length_mla(m.v_head_dim)
    if spec.norm_topk_prob:  # the converter writes it only when true (absent: false)
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(m.qk_rope_head_dim)
    if rope.rope_type == "yarn":  # the converter's 0.1 * mscale_all_dim (llama.cpp divides it back)
        w.add_rope_scaling_yarn_log_mul(0.1 * rope.params["mscale_all_dim"])
