"""Resident weights: checkpoint names -> the `Weights` struct the math runs on (experts excluded).

`resident_refs` is the pure renaming step (testable without files); `load_resident` reads the bytes through the
index and converts them to the compute dtype, checking every shape against the Spec. The projections `kept_quantized`
names (GGUF blocks with an integer kernel, FP8 weights with their block scales, at bf16 / f16) stay in their stored
bytes as QuantLinear instead.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import torch

from ..checkpoint.index import CheckpointIndex
from ..checkpoint.ref import TensorRef
from ..errors import CheckpointError
from ..quant.tensor import read_stored, read_tensor
from .arch import final_of
from .spec import (DeltaNetWeights, HyperWeights, IndexerWeights, LayerWeights, MLAWeights, MLPWeights, PLEWeights,
                   Spec, Weights)
from ..quant import QuantSpec
from ..quant.compute import Compute
from ..quant.linear import QuantLinear, Scratch, quant_spec
from ..store.layout import moe_prefix
from ..store.pages import page_rows


def _expect(index: CheckpointIndex, name: str, shape: tuple[int, ...]) -> TensorRef:
    """The ref of `name`, of `shape`. A stored shape that differs only in size-1 dims is the same elements in the
    same order (converters squeeze or move them: llama.cpp's ffn_gate_inp_shexp [H] for [1, H] and ssm_conv1d
    [C, K] for [C, 1, K], mlx-lm's conv1d [C, K, 1]): the ref is read as `shape` (a block format keeps its rows)."""
    ref = index[name]
    shape = tuple(shape)
    if tuple(ref.shape) == shape:
        return ref
    same = [d for d in ref.shape if d != 1] == [d for d in shape if d != 1]
    if same and shape and ref.shape and (not ref.quantized or ref.shape[-1] == shape[-1]):
        return dataclasses.replace(ref, shape=shape)
    raise CheckpointError(
        f"shape {list(ref.shape)} does not match config.json (expected {list(shape)})", file=ref.path, tensor=name
    )


def resident_refs(index: CheckpointIndex, spec: Spec, arch: ModuleType) -> dict[str, TensorRef]:
    """Every resident tensor as role -> TensorRef, roles like `layers.3.q` / `embed`; shapes validated."""
    s = spec
    H, V = s.hidden_size, s.vocab_size
    refs: dict[str, TensorRef] = {"embed": _expect(index, "model.embed_tokens.weight", (V, H))}
    for t in final_of(arch, s):  # the final norm (hyper-connections: their final mixer)
        refs[t.role] = _expect(index, t.name, t.shape)
    if s.tie_word_embeddings:
        pass  # the reference ties lm_head to the embedding even when a copy is stored
    elif "lm_head.weight" in index:
        refs["lm_head"] = _expect(index, "lm_head.weight", (V, H))
    else:
        raise CheckpointError(
            "lm_head.weight is missing and config.json does not set tie_word_embeddings", file=str(index.folder)
        )
    for L in range(s.n_layers):
        moe = moe_prefix(index, arch, L) if s.moe_layers[L] else None
        for t in arch.layer_tensors(s, L, moe):  # names and shapes: the architecture's (models/arch.py)
            refs[f"layers.{L}.{t.role}"] = _expect(index, t.name, t.shape)
    return refs


# the roles the model math runs through models/linear.py (x @ W^T only): these may stay quantized. Not the embedding
# (rows are gathered), routers (float, small; the prerouter reads their values), nor MLA's kv_b (reshaped per head)
LINEAR_ROLES = frozenset({"q", "k", "v", "o", "mlp.gate", "mlp.up", "mlp.down", "shared.gate", "shared.up",
                          "shared.down", "shared_gate", "mla.q", "mla.q_a", "mla.q_b", "mla.kv_a", "delta.qkv",
                          "delta.z", "delta.b", "delta.a", "delta.qkvz", "delta.ba", "hc_attn.down", "hc_attn.up",
                          "hc_attn.inject", "hc_mlp.down", "hc_mlp.up", "hc_mlp.inject", "indexer.qk", "indexer.q",
                          "indexer.k", "ple.key", "ple.value"})
# roles kept in float32 whatever the compute dtype: router biases (e_score_correction_bias) are added to float32
# scores; a Gated DeltaNet's decay parameters enter its float32 decay (-exp(A_log) * softplus(a + dt_bias))
FLOAT32_ROLES = ("router_bias", "delta.A_log", "delta.dt_bias")


def kept_quantized(refs: dict[str, TensorRef], dtype: torch.dtype) -> dict[str, QuantSpec]:
    """role -> QuantSpec of the resident projections kept in their stored blocks at compute dtype `dtype` (see
    quant/linear.py quant_spec; an untied lm_head included); the others are converted to `dtype`."""
    out = {}
    for role, ref in refs.items():
        if role == "lm_head" or role.split(".", 2)[-1] in LINEAR_ROLES:
            spec = quant_spec(ref, dtype)
            if spec is not None:
                out[role] = spec
    return out


def resident_nbytes(refs: dict[str, TensorRef], dtype: torch.dtype, lazy_embed: bool = False) -> int:
    """Bytes load_resident keeps: stored bytes of the projections kept quantized (an FP8 weight's codes and block
    scales), itemsize x numel of the rest (the token embedding excluded when `lazy_embed`)."""
    quant = kept_quantized(refs, dtype)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    return sum(quant[role].nbytes if role in quant else (4 if role.split(".", 2)[-1] in FLOAT32_ROLES else itemsize) * ref.numel
               for role, ref in refs.items() if not (lazy_embed and role == "embed"))


def _quant_linear(ref: TensorRef, spec: QuantSpec, compute: Compute, scratch: Scratch,
                  arena: "_Arena") -> QuantLinear:
    return QuantLinear(spec, arena.place(read_stored(ref, spec)), compute, scratch)  # rows in Hugging Face order


class _Arena:
    """The kept-quantized projections' bytes side by side in one page-aligned block in huge pages (store/pages.py),
    each at a 64-byte boundary: a decode step streams all of them (the attention projections and the LM head), and
    in 4 KiB pages each 4 KiB costs a TLB miss (breakdown.py moe: `linears`)."""

    def __init__(self, nbytes: int):
        self.buf, self.at = page_rows(1, nbytes, "the kept-quantized projections")[0] if nbytes else None, 0

    @staticmethod
    def size(n: int) -> int:
        return (n + 63) // 64 * 64

    def place(self, raw: torch.Tensor) -> torch.Tensor:
        """raw (uint8 [n]) copied into the block: the same bytes, a view of the block"""
        n = raw.numel()
        out = self.buf[self.at : self.at + n]
        out.copy_(raw)
        self.at += self.size(n)
        return out


def load_resident(refs: dict[str, TensorRef], spec: Spec, compute: Compute, lazy_embed: bool = False) -> Weights:
    """Read every resident tensor and assemble the Weights struct in the compute dtype (`lazy_embed`: leave the
    token embedding on disk; the model then gathers its rows through a RowTable). The projections kept_quantized
    names become QuantLinears sharing one scratch, computing as `compute` says (quant/compute.py)."""
    dtype = compute.dtype

    def as_dtype(role: str) -> torch.dtype:
        return torch.float32 if role.split(".", 2)[-1] in FLOAT32_ROLES else dtype

    quant, scratch = kept_quantized(refs, dtype), Scratch()
    arena = _Arena(sum(_Arena.size(quant[role].nbytes) for role in refs if role in quant
                       and not (lazy_embed and role == "embed")))
    t = {role: _quant_linear(ref, quant[role], compute, scratch, arena) if role in quant
         else read_tensor(ref, as_dtype(role)).to(as_dtype(role))
         for role, ref in refs.items() if not (lazy_embed and role == "embed")}

    layers = [_layer_weights(t, f"layers.{L}.") for L in range(spec.n_layers)]
    embed = t.get("embed")
    lm_head = t["lm_head"] if "lm_head" in t else embed
    assert lm_head is not None, "a tied LM head needs the resident embedding"
    return Weights(embed=embed, norm=t.get("norm"), lm_head=lm_head, layers=layers,
                   hc_mixer=_group(t, "hc_mixer.", HyperWeights, "norm"))


def _group(t: dict, prefix: str, cls, key: str):
    """`cls` (MLAWeights: roles `mla.kv_a`, ...; DeltaNetWeights: `delta.conv`, ...) of the roles under `prefix`, or
    None when `prefix + key` is not among them."""
    if prefix + key not in t:
        return None
    n = len(prefix)
    return cls(**{role[n:]: w for role, w in t.items() if role.startswith(prefix)})


def _kv_b_joined(t: dict, prefix: str) -> dict:
    """`t` with a latent attention's split kv_b (roles `{prefix}k_b` [nH, r, N], `{prefix}v_b` [nH, V, r]: llama.cpp's
    converter's transposed key part and value part per head) joined back into `{prefix}kv_b` [nH*(N+V), r], the
    checkpoint's own (each head's N key rows, then its V value rows): the same values, moved."""
    if prefix + "k_b" not in t:
        return t
    t = dict(t)
    k_b, v_b = t.pop(prefix + "k_b"), t.pop(prefix + "v_b")
    t[prefix + "kv_b"] = torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, k_b.shape[1])
    return t


def _layer_weights(t: dict, r: str) -> LayerWeights:
    """The LayerWeights of the roles under `r` (`layers.L.`)."""
    def mlp(prefix: str) -> MLPWeights | None:
        if prefix + "gate" not in t:
            return None
        return MLPWeights(t[prefix + "gate"], t[prefix + "up"], t[prefix + "down"])

    return LayerWeights(
        o=t[r + "o"], input_norm=t.get(r + "input_norm"), post_norm=t.get(r + "post_norm"),
        q=t.get(r + "q"), k=t.get(r + "k"), v=t.get(r + "v"),
        mla=_group(_kv_b_joined(t, r + "mla."), r + "mla.", MLAWeights, "kv_a"),
        delta=_group(t, r + "delta.", DeltaNetWeights, "conv"),
        q_bias=t.get(r + "q_bias"), k_bias=t.get(r + "k_bias"), v_bias=t.get(r + "v_bias"), o_bias=t.get(r + "o_bias"),
        q_norm=t.get(r + "q_norm"), k_norm=t.get(r + "k_norm"),
        router=t.get(r + "router"), router_bias=t.get(r + "router_bias"), sinks=t.get(r + "sinks"),
        mlp=mlp(r + "mlp."), shared=mlp(r + "shared."), shared_gate=t.get(r + "shared_gate"),
        hc_attn=_group(t, r + "hc_attn.", HyperWeights, "norm"), hc_mlp=_group(t, r + "hc_mlp.", HyperWeights, "norm"),
        indexer=_group(t, r + "indexer.", IndexerWeights, "q_norm"), ple=_group(t, r + "ple.", PLEWeights, "key"),
    )
