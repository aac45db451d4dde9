"""Resident weights: checkpoint names -> the `Weights` struct the math runs on (experts excluded).

`resident_names` is the pure renaming step (testable without files); `load_resident` reads the bytes through the
index and converts them to the compute dtype, checking every shape against the Spec.
"""

from __future__ import annotations

from types import ModuleType

import torch

from ..checkpoint.index import CheckpointIndex
from ..checkpoint.ref import TensorRef
from ..errors import CheckpointError
from ..io.tensor import read_tensor
from ..models.spec import LayerWeights, MLAWeights, MLPWeights, Spec, Weights
from .layout import moe_prefix


def _expect(index: CheckpointIndex, name: str, shape: tuple[int, ...]) -> TensorRef:
    ref = index[name]
    if tuple(ref.shape) != tuple(shape):
        raise CheckpointError(
            f"shape {list(ref.shape)} does not match config.json (expected {list(shape)})", file=ref.path, tensor=name
        )
    return ref


def resident_refs(index: CheckpointIndex, spec: Spec, arch: ModuleType) -> dict[str, TensorRef]:
    """Every resident tensor as role -> TensorRef, roles like `layers.3.q` / `embed`; shapes validated."""
    s = spec
    H, V = s.hidden_size, s.vocab_size
    refs: dict[str, TensorRef] = {
        "embed": _expect(index, "model.embed_tokens.weight", (V, H)),
        "norm": _expect(index, "model.norm.weight", (H,)),
    }
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


def load_resident(refs: dict[str, TensorRef], spec: Spec, dtype: torch.dtype, lazy_embed: bool = False) -> Weights:
    """Read every resident tensor and assemble the Weights struct in `dtype` (`lazy_embed`: leave the token
    embedding on disk; the model then gathers its rows through a RowTable)."""
    def as_dtype(role: str) -> torch.dtype:  # router biases (e_score_correction_bias) are added to float32 scores
        return torch.float32 if role.endswith(".router_bias") else dtype

    t = {role: read_tensor(ref, as_dtype(role)).to(as_dtype(role))
         for role, ref in refs.items() if not (lazy_embed and role == "embed")}

    def mlp(prefix: str) -> MLPWeights | None:
        if prefix + "gate" not in t:
            return None
        return MLPWeights(t[prefix + "gate"], t[prefix + "up"], t[prefix + "down"])

    def mla(prefix: str) -> MLAWeights | None:  # latent attention (models/mla.py): roles `mla.kv_a`, ...
        if prefix + "kv_a" not in t:
            return None
        n = len(prefix)
        return MLAWeights(**{role[n:]: w for role, w in t.items() if role.startswith(prefix)})

    layers = []
    for L in range(spec.n_layers):
        r = f"layers.{L}."
        layers.append(
            LayerWeights(
                input_norm=t[r + "input_norm"],
                post_norm=t[r + "post_norm"],
                q=t.get(r + "q"),
                k=t.get(r + "k"),
                v=t.get(r + "v"),
                o=t[r + "o"],
                mla=mla(r + "mla."),
                q_bias=t.get(r + "q_bias"),
                k_bias=t.get(r + "k_bias"),
                v_bias=t.get(r + "v_bias"),
                o_bias=t.get(r + "o_bias"),
                q_norm=t.get(r + "q_norm"),
                k_norm=t.get(r + "k_norm"),
                router=t.get(r + "router"),
                router_bias=t.get(r + "router_bias"),
                sinks=t.get(r + "sinks"),
                mlp=mlp(r + "mlp."),
                shared=mlp(r + "shared."),
                shared_gate=t.get(r + "shared_gate"),
            )
        )
    embed = t.get("embed")
    lm_head = t["lm_head"] if "lm_head" in t else embed
    assert lm_head is not None, "a tied LM head needs the resident embedding"
    return Weights(embed=embed, norm=t["norm"], lm_head=lm_head, layers=layers)
