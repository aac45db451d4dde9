"""GGUF files for the tests: written by the `gguf` package (the reference writer), laid out as llama.cpp's
convert_hf_to_gguf.py lays out each architecture, plus a raw header builder for files no writer would produce."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf.quants import quantize  # noqa: E402

from tests.quant.samples import F16_FIELDS, write_f16  # noqa: E402

Q = gguf.GGMLQuantizationType
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "mixtral": "llama"}
# HF config per arch that llama.cpp's graph can express (no dense layers, no sliding window, no clip_qkv); the
# qwen2_moe one keeps its YaRN rope so the rope-scaling keys are exercised.
GGUF_TINY = {"qwen3_moe": dict(mlp_only_layers=[]), "qwen2_moe": dict(mlp_only_layers=[], use_sliding_window=False),
             "olmoe": dict(clip_qkv=None), "mixtral": dict(sliding_window=None)}


#: the largest |value| a block of each type gives at d = 1 (its largest sub-scale times its largest code): random
#: blocks of these types get d of about 0.3 / SPAN, so that their values are of the tiny models' size (~N(0, 0.1))
SPAN = {"Q2_K": 45, "Q3_K": 128, "IQ1_S": 17, "IQ1_M": 17, "IQ2_XXS": 166, "IQ2_XS": 166, "IQ2_S": 166,
        "IQ3_XXS": 480, "IQ3_S": 465, "IQ4_NL": 127, "IQ4_XS": 4064}
#: the block types the `gguf` package cannot quantize: encode() writes random valid blocks of them
RANDOM_BLOCKS = frozenset({Q.Q4_K, Q.Q5_K, Q.Q6_K} | {Q[name] for name in SPAN})


def random_blocks(qtype, n_blocks: int, seed: int = 0) -> np.ndarray:
    """`n_blocks` blocks of a K-quant or IQ type with random bytes and finite f16 super-block scales: valid blocks
    that `gguf.quants.dequantize` turns into finite values (the package cannot quantize these types)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        scales = rng.uniform(-0.01, 0.01, size=(n_blocks, 2)).astype(np.float16).view(np.uint8)  # [n, 4]
        if qtype == Q.Q6_K:
            raw[:, -2:] = scales[:, :2]  # d closes the block
        else:
            raw[:, 0:4] = scales  # d, dmin lead the block
    elif qtype.name in SPAN:
        for at in F16_FIELDS[qtype.name]:
            d = rng.uniform(0.5, 1.5, n_blocks) * rng.choice([-1.0, 1.0], n_blocks) * 0.3 / SPAN[qtype.name]
            write_f16(raw, qtype.name, at, d.astype(np.float16).view(np.uint16))
    else:
        raise ValueError(f"random blocks of {qtype.name} are not implemented")
    return raw


def encode(values: np.ndarray, qtype, seed: int = 0) -> np.ndarray:
    """float32 `values` [..., n] as GGUF data of type `qtype` (bytes for block formats; the types of RANDOM_BLOCKS
    are random blocks seeded by `seed`, not an encoding of `values`)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if qtype == Q.F32:
        return values
    if qtype == Q.F16:
        return values.astype(np.float16)
    if qtype in RANDOM_BLOCKS:
        rows = values.reshape(-1, values.shape[-1])
        per_row = values.shape[-1] // gguf.GGML_QUANT_SIZES[qtype][0]
        blocks = random_blocks(qtype, rows.shape[0] * per_row, seed)
        return blocks.reshape(*values.shape[:-1], per_row * blocks.shape[1])
    return quantize(values, qtype)


def add(w, name: str, values: np.ndarray, qtype=None) -> None:
    """Add tensor `name` (float32 `values`, torch order) to GGUFWriter `w` as `qtype` (F32 for 1-D tensors)."""
    qtype = Q.F32 if qtype is None or values.ndim == 1 else qtype
    data = encode(values, qtype, zlib.crc32(name.encode()))
    raw = None if qtype in (Q.F32, Q.F16) else qtype
    w.add_tensor(name, data, raw_dtype=raw)


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: q/k rows reordered for llama.cpp's interleaved rope."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert(model, out: Path, qtype: Callable[[str], object] | None = None, tie: bool = False,
            split_max_tensors: int = 0, extra: Callable | None = None, fuse_gate_up: bool = False) -> Path:
    """Write transformers `model` as convert_hf_to_gguf.py would: llama.cpp names, experts stacked [E, I, H] (or
    gate and up fused into ffn_gate_up_exps [E, 2I, H], its --fuse-gate-up-exps), q/k permuted for `llama`, the
    hparams keys, a dummy token list. `qtype(gguf_name)` picks each 2-D tensor's type (F32 when None). Returns the
    path of the (first) file written; `extra(writer)` may add or change keys and tensors first."""
    cfg = model.config
    hf = cfg.model_type
    arch = GGUF_ARCH[hf]
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(out, arch, split_max_tensors=split_max_tensors)
    _hparams(w, cfg, hf)
    if extra is not None:
        extra(w)
    pick = qtype or (lambda name: Q.F32)
    H, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads

    def put(name: str, values: np.ndarray) -> None:
        add(w, name, values, pick(name))

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    for n in range(cfg.num_hidden_layers):
        p, g = f"model.layers.{n}", f"blk.{n}"
        put(f"{g}.attn_norm.weight", sd[f"{p}.input_layernorm.weight"])
        for hname, gname in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
            t = sd[f"{p}.self_attn.{hname}_proj.weight"]
            if arch == "llama" and hname in "qk":
                t = permute(t, heads, heads if hname == "q" else kv)
            put(f"{g}.{gname}.weight", t)
            if f"{p}.self_attn.{hname}_proj.bias" in sd:
                put(f"{g}.{gname}.bias", sd[f"{p}.self_attn.{hname}_proj.bias"])
        for hname in ("q_norm", "k_norm"):
            if f"{p}.self_attn.{hname}.weight" in sd:
                put(f"{g}.attn_{hname}.weight", sd[f"{p}.self_attn.{hname}.weight"])
        put(f"{g}.ffn_norm.weight", sd[f"{p}.post_attention_layernorm.weight"])
        put(f"{g}.ffn_gate_inp.weight", sd[f"{p}.mlp.gate.weight"])
        gu = sd[f"{p}.mlp.experts.gate_up_proj"]  # [E, 2I, H], gate rows first
        i = gu.shape[1] // 2
        if fuse_gate_up:
            put(f"{g}.ffn_gate_up_exps.weight", gu)
        else:
            put(f"{g}.ffn_gate_exps.weight", gu[:, :i])
            put(f"{g}.ffn_up_exps.weight", gu[:, i:])
        put(f"{g}.ffn_down_exps.weight", sd[f"{p}.mlp.experts.down_proj"])
        if f"{p}.mlp.shared_expert_gate.weight" in sd:
            put(f"{g}.ffn_gate_inp_shexp.weight", sd[f"{p}.mlp.shared_expert_gate.weight"].reshape(H))
            for proj in ("gate", "up", "down"):
                put(f"{g}.ffn_{proj}_shexp.weight", sd[f"{p}.mlp.shared_expert.{proj}_proj.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    if not tie:
        put("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(Path(out))[0]


def _hparams(w, cfg, hf: str) -> None:
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    rope = dict(cfg.rope_parameters or {})
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_feed_forward_length(cfg.intermediate_size)
    if hf in ("qwen3_moe", "qwen2_moe"):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if hf == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


# -- raw headers ------------------------------------------------------------------------------------------------------
def s(text: str | bytes) -> bytes:
    """A GGUF string: u64 length + bytes."""
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    """One metadata entry: key, value type, raw value bytes."""
    return s(key) + struct.pack("<I", vtype) + payload


def tinfo(name: str | bytes, dims: tuple[int, ...], type_id: int, offset: int) -> bytes:
    """One tensor info (dims innermost first, as stored)."""
    return s(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, type_id, offset)


def raw_gguf(kvs: list[bytes], infos: list[bytes], data: bytes = b"", version: int = 3, align: int = 32,
             magic: bytes = b"GGUF") -> bytes:
    """A whole file: header, metadata, tensor infos, padding to `align`, then `data`."""
    head = magic + struct.pack("<IQQ", version, len(infos), len(kvs)) + b"".join(kvs) + b"".join(infos)
    if infos:
        head += b"\0" * (-len(head) % align)
    return head + data


def f32_tensor_file(n: int = 3, numel: int = 8) -> tuple[bytes, list[np.ndarray]]:
    """A valid raw file of `n` F32 tensors of `numel` values each, packed as llama.cpp requires."""
    values = [np.arange(numel, dtype=np.float32) + 100 * i for i in range(n)]
    infos, data = [], b""
    for i, v in enumerate(values):
        infos.append(tinfo(f"t{i}", (numel,), 0, len(data)))
        data += v.tobytes() + b"\0" * (-v.nbytes % 32)
    return raw_gguf([kv("general.architecture", 8, s("test"))], infos, data), values
