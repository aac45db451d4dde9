"""Tiny qwen4_exp checkpoints in shapes llama.cpp runs, saved by transformers with a trained tokenizer, and their GGUFs
as llama.cpp's converter writes them (tests/checkpoint/llama_cpp.py), plus copies of a GGUF with a key or tensor
changed (the `gguf` package's reader and writer): the files tests/models/test_qwen4_exp_gguf.py reads.

llama.cpp's qwen4exp holds one PLE layer (one per_layer_token_embd table), feeds its key / value projections the
hidden size (ple_embed_dim = hidden_size) and takes one head size for the linear attention's keys and values. Its
converter refuses --no-mtp for the architecture, and reads config.json through transformers, which renames the hub's
"full_attention" layers "indexed_attention": its own `== "full_attention"` test then never matches and it writes
attention.compress_ratios 0 on every layer, which llama.cpp runs as dense attention (no QSA). `with_ratios` writes
the ratio the checkpoint has, as the converter means to.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.checkpoint import llama_cpp
from tests.checkpoint.hybrid_files import hf_folder
from tests.models.tiny import TINY

gguf = pytest.importorskip("gguf")

TEXT = TINY["qwen4_exp"]["text_config"]
# one PLE layer of two heads (a trigram's and a bigram's) 32 wide: rows of whole Q8_0 / Q4_0 blocks
LLAMA_TEXT = {**TEXT, "ple_layer_ids": [1], "ple_embed_dim": 64, "heads_per_ngram": 1, "linear_value_head_dim": 8}
# the same with rows of 256 (a K-quant block): ple_embed_dim above the hidden size, which sluice runs (llama.cpp not)
WIDE_TEXT = {**LLAMA_TEXT, "ple_embed_dim": 512}
TABLE = "per_layer_token_embd.weight"


def gguf_file(root: Path, text: dict) -> tuple[Path, object, Path]:
    """(the tiny qwen4_exp of `text` saved by transformers in `root`/hf, the model, its F32 GGUF by llama.cpp's
    converter), the folder's layer types written as the hub writes them ("full_attention")."""
    folder, model = hf_folder("qwen4_exp", root, text_config=text)
    cfg = json.loads((folder / "config.json").read_text())
    types = cfg["text_config"]["layer_types"]
    cfg["text_config"]["layer_types"] = ["full_attention" if t == "indexed_attention" else t for t in types]
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, model, llama_cpp.convert(folder, root / "m-f32.gguf", no_mtp=False)


def rewrite(src: Path, out: Path, meta: dict | None = None, drop: tuple[str, ...] = (),
            tensors: dict | None = None) -> Path:
    """A copy of GGUF `src` as `out`: metadata `meta` (key -> (value, GGUFValueType, element type or None)) set,
    keys `drop` left out, `tensors` (name -> (numpy data, GGMLQuantizationType), or None: left out) in place of
    the file's."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out, r.fields["general.architecture"].contents())
    meta = meta or {}
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop or key in meta:
            continue
        vtype = f.types[0]
        w.add_key_value(key, f.contents(), vtype, f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for key, (value, vtype, sub) in meta.items():
        w.add_key_value(key, value, vtype, sub)
    for t in r.tensors:
        new = (tensors or {}).get(t.name, (t.data, t.tensor_type))
        if new is None:
            continue
        data, qtype = new
        w.add_tensor(t.name, np.ascontiguousarray(data), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def with_ratios(src: Path, out: Path, ratio: int) -> Path:
    """`src` with attention.compress_ratios `ratio` on its attention layers (0 on the recurrent ones): what the
    converter writes where it recognises them (the module docstring)."""
    r = gguf.GGUFReader(src)
    recurrent = r.fields["qwen4exp.attention.recurrent_layers"].contents()
    ratios = [0 if x else ratio for x in recurrent]
    V = gguf.GGUFValueType
    return rewrite(src, out, meta={"qwen4exp.attention.compress_ratios": (ratios, V.ARRAY, V.INT32)})


def table_of(path: Path) -> np.ndarray:
    """The n-gram table of GGUF `path` as float32 [rows, width] (the gguf package's dequantization)."""
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == TABLE)
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1, t.shape[0])


def retyped_table(src: Path, root: Path, qtype) -> tuple[Path, Path]:
    """(`src` with its n-gram table stored as `qtype`, the same with the table as F32 values of that storage's
    dequantization: the reference). The types the gguf package cannot encode (K, IQ) are random valid blocks."""
    from tests.checkpoint.gguf_files import encode

    values = table_of(src)
    data = encode(values, qtype, seed=11)
    exact = np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32).reshape(values.shape)
    quant = rewrite(src, root / f"table-{qtype.name}.gguf", tensors={TABLE: (data, qtype)})
    f32 = gguf.GGMLQuantizationType.F32
    return quant, rewrite(src, root / f"table-{qtype.name}-f32.gguf", tensors={TABLE: (exact, f32)})
