"""Where the per-layer embedding tables are (Spec.ple, qwen4_exp's n-gram tables): layer -> the table's parts, as a
row table reads them (store/rows.py RowTable: one logical table over its parts, never concatenated).

The hub stores each table in parts, `{table}.shard_0.weight` ... `{table}.shard_{K-1}.weight` (transformers splits
it with torch.chunk into `split_ngram_parts` pieces and concatenates them in the numeric order of K when loading);
a table saved whole, `{table}.weight`, reads too. Whatever the split, the parts must stack to the rows config.json
gives (PLESpec.rows: the heads' prime sizes, padded) with head_dim columns. A GGUF holds the table whole
(`per_layer_token_embd`, mapped to `{table}.weight` by models/qwen4_exp.py), in F32 / F16 / BF16 or any block format
sluice dequantizes (quant/ggml.py: Q8_0, Q4_K, ... rows of whole blocks, dequantized per read by RowTable).
"""

from __future__ import annotations

import re

from ..checkpoint.index import CheckpointIndex
from ..checkpoint.ref import DTYPES, TensorRef
from ..errors import CheckpointError
from ..quant.ggml import DEQUANTIZABLE
from ..quant.tensor import read_tensor
from .spec import Spec


def ple_tables(index: CheckpointIndex, spec: Spec) -> dict[int, list[TensorRef]]:
    """layer -> the parts of its PLE table, in row order; CheckpointError naming the table (or the part) when one is
    missing, a shard is missing from the sequence, or the parts do not stack to the table config.json describes."""
    p = spec.ple
    if p is None:
        return {}
    out = {}
    for i, L in enumerate(p.layers):
        name = p.table.format(layer=L)
        parts = _parts(index, name)
        first = parts[0]
        for part in parts:
            if part.mlx is not None or part.dtype not in DEQUANTIZABLE or len(part.shape) != 2 \
                    or part.shape[1] != p.head_dim:
                shape = list(part.shape)
                raise CheckpointError(
                    f"a part of layer {L}'s n-gram table must be [rows, {p.head_dim}] (ple_embed_dim / n-gram heads) "
                    f"of {', '.join(sorted(DEQUANTIZABLE))}, got {shape} of {part.dtype}", file=part.path,
                    tensor=part.name)
            if part.dtype != first.dtype:
                raise CheckpointError(f"is {part.dtype} where the table's first part is {first.dtype}",
                                      file=part.path, tensor=part.name)
        rows = sum(part.shape[0] for part in parts)
        if rows != p.rows[i]:
            raise CheckpointError(
                f"layer {L}'s n-gram table has {rows} rows in {len(parts)} part(s), but config.json describes "
                f"{p.rows[i]} (its heads' prime sizes from ngram_vocab_size_base, padded to "
                "make_ngram_vocab_size_divisible_by): a checkpoint of another config", file=first.path,
                tensor=name)
        out[L] = parts
    return out


def _parts(index: CheckpointIndex, name: str) -> list[TensorRef]:
    """The refs of table `name`: its shards in the order of their numbers, or the whole tensor."""
    shard = re.compile(re.escape(name) + r"\.shard_(\d+)\.weight")
    found = {int(m.group(1)): n for n in index if (m := shard.fullmatch(n))}
    whole = f"{name}.weight"
    if whole in index and found:
        raise CheckpointError(f"the checkpoint holds both {whole} and {len(found)} shards of it: keep one",
                              file=index[whole].path, tensor=whole)
    if whole in index:
        return [index[whole]]
    if not found:
        raise CheckpointError(f"missing: neither {whole} nor its shards {name}.shard_K.weight are in the checkpoint",
                              file=str(index.folder), tensor=whole)
    gaps = sorted(set(range(max(found) + 1)) - set(found))
    if gaps:
        raise CheckpointError(f"shard {gaps[0]} of {len(found) + len(gaps)} is missing (shards 0..{max(found)} "
                              "stack in order)", file=str(index.folder), tensor=f"{name}.shard_{gaps[0]}.weight")
    return [index[found[k]] for k in range(len(found))]


def check_hashes(index: CheckpointIndex, spec: Spec) -> None:
    """The hash numbers transformers saves beside a table (layer multipliers, head sizes and offsets), where the
    checkpoint has them, must be the ones config.json gives (PLESpec; models/ngram.py): CheckpointError naming the
    tensor otherwise (its rows would be looked up at other places). Reads a few bytes per PLE layer."""
    p = spec.ple
    if p is None:
        return
    for i, L in enumerate(p.layers):
        for role, want in (("multipliers", p.multipliers[i]), ("sizes", p.head_sizes[i]),
                           ("offsets", p.offsets[i])):
            name = p.hashes.get(role, "").format(layer=L)
            if not name or name not in index:
                continue
            ref = index[name]
            got = read_tensor(ref).tolist() if ref.dtype in DTYPES and ref.numel == len(want) else None
            if got != want:
                raise CheckpointError(
                    f"holds {got if got is not None else list(ref.shape)} where config.json gives {want} (seed, "
                    "ngram_vocab_size_base, ngram_size, heads_per_ngram, vocab_size): the table was hashed with other "
                    "numbers", file=ref.path, tensor=name)
