"""GGUFIndex: a GGUF file (or a gguf-split set) presented as sluice's CheckpointIndex: an HF config + HF tensor names.

Tensor names map to the ones sluice's model files read (models/*.py, weights.py, store/layout.py):

    token_embd.weight                 model.embed_tokens.weight
    output_norm.weight, output.weight model.norm.weight, lm_head.weight (absent: tied embeddings)
    blk.N.attn_norm / ffn_norm        model.layers.N.input_layernorm / post_attention_layernorm
    blk.N.attn_{q,k,v,output}         model.layers.N.self_attn.{q,k,v,o}_proj        (.weight; .bias for qwen2moe)
    blk.N.attn_{q,k}_norm             model.layers.N.self_attn.{q,k}_norm            (qwen3moe, olmoe)
    blk.N.ffn_gate_inp                model.layers.N.mlp.gate.weight                  router [E, H]
    blk.N.ffn_{gate,up}_exps          model.layers.N.mlp.experts.{gate,up}_proj       [E, I, H], experts stacked
    blk.N.ffn_down_exps               model.layers.N.mlp.experts.down_proj            [E, H, I]
    blk.N.ffn_gate_up_exps            model.layers.N.mlp.experts.gate_up_proj         [E, 2I, H] (gate rows first)
    blk.N.ffn_{gate,up,down}_shexp    model.layers.N.mlp.shared_expert.*_proj.weight  (qwen2moe)
    blk.N.ffn_gate_inp_shexp          model.layers.N.mlp.shared_expert_gate.weight    [1, H] (stored [H] or [1, H])

Each architecture's table is its `GGUFArch.tensors` (declared by models/<model_type>.py, handed to `GGUFIndex.open`
by the opener: plan.open_index), and `GGUFArch.other_tensors` for its own tensors outside the blocks (qwen4exp's
output_hc_* and per_layer_token_embd, whose name depends on the config). The MoE block is always `mlp`
(Mixtral included: its fused HF layout uses that prefix too). Each mapped TensorRef keeps the GGUF name as
`ref.name`, so errors name the tensor as it is in the file. A tensor the architecture does not have in llama.cpp is an
error (llama.cpp refuses such files too). Where the architecture says `rope_permuted` (`llama`: Mixtral) the q/k rows
are stored permuted for llama.cpp's interleaved rope; their refs carry `rope_heads` (see TensorRef.row_order). Where
its `values` name a tensor, the converter mapped its values (a zero-centred norm stored as 1 + w); its ref carries
`values` (TensorRef.values) and reads as the Hugging Face values. Tensors of the blocks after the model's layers
(nextn_predict_layers: a multi-token-prediction head) are listed under their GGUF names and never read. Shapes stay
the file's: a converter's squeezed size-1 dim (ffn_gate_inp_shexp [H], ssm_conv1d [C, K]) is read as transformers'
shape by models/weights.py.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from ..errors import CheckpointError
from .gguf import INTEGER_TYPES, GGUFFile, read_gguf
from .gguf_arch import GGUFArch, GGUFArchs
from .gguf_config import GGUFMeta, gguf_arch, gguf_config
from .index import CheckpointIndex
from .paths import path_kind
from .ref import TensorRef

# gguf-split / gguf-py shard names: PREFIX-00001-of-00003.gguf (llama.cpp's llama_split_path)
_SPLIT_RE = re.compile(r"(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
_BLK_RE = re.compile(r"blk\.(?P<layer>\d+)\.(?P<rest>.+)")

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_ROPE_FREQS_HINT = "per-dimension rope factors (llama3-style rope scaling) are not supported"
_OLD_EXPERTS = re.compile(r"ffn_(gate|up|down)\.\d+\.weight")
_OLD_EXPERTS_HINT = "this is the old per-expert Mixtral layout: re-convert the model with a current llama.cpp"


def gguf_name(name: str, facts: GGUFArch, config: dict | None = None) -> str | None:
    """The GGUF name of config.json-world tensor `name` in architecture `facts` (the inverse of hf_name; `config`:
    the file's, for the architecture's own global tensors)."""
    for g, h in {**_GLOBAL, **(facts.global_tensors(config) if config is not None else {})}.items():
        if h == name:
            return g
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m:
        for g, h in facts.tensors.items():
            if h == m[2]:
                return f"blk.{m[1]}.{g}"
    return None


def hf_name(gguf_name: str, facts: GGUFArch, n_layers: int, config: dict | None = None) -> str | None:
    """The config.json-world name of GGUF tensor `gguf_name` in architecture `facts`, or None if it has none
    (`config`: the file's, for the architecture's own global tensors: GGUFArch.other_tensors)."""
    glob = {**_GLOBAL, **(facts.global_tensors(config) if config is not None else {})}
    if gguf_name in glob:
        return glob[gguf_name]
    m = _BLK_RE.fullmatch(gguf_name)
    if m is None or int(m["layer"]) >= n_layers or str(int(m["layer"])) != m["layer"]:
        return None
    rest = facts.tensors.get(m["rest"])
    return None if rest is None else f"model.layers.{m['layer']}.{rest}"


def split_files(first: GGUFFile) -> list[GGUFFile]:
    """All shards of a gguf-split set whose first file is `first` (just [first] for a single file).

    llama.cpp's rules: the first file carries the metadata and `split.count` N; shard i (0-based) is
    PREFIX-{i+1:05d}-of-{N:05d}.gguf beside it with `split.no` = i; the shards together hold `split.tensors.count`
    tensors, no name twice. Missing, extra or inconsistent shards are a CheckpointError naming the file.
    """
    path = first.path
    meta = first.metadata
    m = _SPLIT_RE.fullmatch(path.name)
    if "split.count" not in meta:
        if m and int(m["count"]) > 1:
            raise CheckpointError(f"is named as split {int(m['no'])} of {int(m['count'])} but has no split.count "
                                  "metadata; the split set is corrupt: re-download it", file=str(path))
        return [first]
    count = _split_int(first, "split.count", 1)
    no = _split_int(first, "split.no", 0) if "split.no" in meta else 0
    if no != 0:
        first_name = _SPLIT_RE.sub(lambda g: f"{g['prefix']}-00001-of-{g['count']}.gguf", path.name)
        raise CheckpointError(f"is split {no + 1} of {count}; open the first split, {first_name}", file=str(path))
    if count == 1:
        return [first]
    if not m or int(m["no"]) != 1 or int(m["count"]) != count:
        raise CheckpointError(f"holds split 1 of {count}, so its name must end in -00001-of-{count:05d}.gguf "
                              "(gguf-split's naming) to find the other splits; rename it", file=str(path))
    prefix = m["prefix"]
    _no_extra_splits(path.parent, prefix, count)
    files = [first]
    total = _split_int(first, "split.tensors.count", 0) if "split.tensors.count" in meta else None
    for i in range(1, count):
        shard = path.with_name(f"{prefix}-{i + 1:05d}-of-{count:05d}.gguf")
        if not shard.is_file():
            raise CheckpointError(f"split {i + 1} of {count} is missing (the first split is {path.name}); download "
                                  "every split into one folder", file=str(shard))
        gf = read_gguf(shard)
        for key, want in (("split.no", i), ("split.count", count)):
            if key not in gf.metadata or _split_int(gf, key, 0) != want:
                raise CheckpointError(f"{key} is {gf.metadata.get(key)!r}, expected {want} for split {i + 1} of "
                                      f"{count}; the split set is inconsistent: re-download it", file=str(shard))
        if "split.tensors.count" in gf.metadata and _split_int(gf, "split.tensors.count", 0) != total:
            raise CheckpointError(f"split.tensors.count {gf.metadata['split.tensors.count']} differs from the first "
                                  f"split's {total}; the split set is inconsistent: re-download it", file=str(shard))
        files.append(gf)
    n = sum(len(gf.tensors) for gf in files)
    if total is not None and n != total:
        raise CheckpointError(f"split.tensors.count says {total} tensors but the {count} splits hold {n}; "
                              "re-download the split set", file=str(path))
    return files


_SPLIT_MAX = {"split.no": 65535, "split.count": 65535, "split.tensors.count": 2**31 - 1}  # u16, u16, i32


def _split_int(gf: GGUFFile, key: str, minimum: int) -> int:
    v = gf.metadata[key]
    if gf.types[key] not in INTEGER_TYPES or not minimum <= v <= _SPLIT_MAX[key]:
        raise CheckpointError(f"metadata {key} = {v!r} is not a valid split value; re-download the split set",
                              file=str(gf.path))
    return v


def _no_extra_splits(folder: Path, prefix: str, count: int) -> None:
    pattern = re.compile(re.escape(prefix) + rf"-(\d{{5}})-of-{count:05d}\.gguf")
    for p in folder.iterdir():
        g = pattern.fullmatch(p.name)
        if g and not 1 <= int(g[1]) <= count:
            raise CheckpointError(f"is split {int(g[1])} of a {count}-split set; a stray file from another download? "
                                  "remove it", file=str(p))


class GGUFIndex(CheckpointIndex):
    """A GGUF model (one file or a split set) as config + HF tensor name -> TensorRef; no tensor bytes are read.

    Beyond CheckpointIndex: `arch` (GGUF architecture), `facts` (its GGUFArch), `metadata` (the first file's key ->
    value, for the tokenizer and chat template: tokenizer.ggml.*), `gguf_files` (each parsed shard), `gguf_names`
    (HF name -> GGUF name).
    `folder` is the first .gguf file, so errors that name the checkpoint name the file the user passed.
    """

    def __init__(self, path: Path, config: dict, tensors: dict[str, TensorRef], gguf_files: list[GGUFFile],
                 facts: GGUFArch, gguf_names: dict[str, str]):
        super().__init__(path, config, None, tensors, [gf.path for gf in gguf_files])
        self.facts = facts
        self.arch = facts.name
        self.gguf_files = gguf_files
        self.metadata = gguf_files[0].metadata
        self.gguf_names = gguf_names

    @classmethod
    def open(cls, path: str | os.PathLike[str], archs: GGUFArchs) -> GGUFIndex:
        """Parse `path` (a .gguf file, or the first of a split set) and its other splits; map config and names by
        the facts of its architecture in `archs` (general.architecture -> GGUFArch: models.gguf_archs()).

        Raises CheckpointError for a bad file, a bad split set or a tensor the architecture does not have, and
        ConfigError for an architecture or setting sluice does not run.
        """
        path = Path(path)
        try:
            kind = path_kind(path)
        except OSError as e:  # a name too long, a permission denied on a parent
            raise CheckpointError(f"cannot open: {e.strerror or e}", file=str(path)) from None
        if kind != "file":
            raise CheckpointError(f"{'not found' if kind == 'missing' else 'is ' + kind}; pass a .gguf file",
                                  file=str(path))
        first = read_gguf(path)
        files = split_files(first)  # first: a later split gets "open the first split", not a missing-metadata error
        facts = gguf_arch(first, archs)
        raw: dict[str, TensorRef] = {}
        for gf in files:
            for name, ref in gf.tensors.items():
                if name in raw:
                    raise CheckpointError(f"also stored in {Path(raw[name].path).name}; the split set is "
                                          "inconsistent: re-download it", file=str(gf.path), tensor=name)
                raw[name] = ref
        config = gguf_config(first, raw, facts)
        blocks = GGUFMeta(first, facts.name).int("block_count")
        tensors, names = _map_tensors(raw, facts, config, blocks, str(path))
        return cls(path, config, tensors, files, facts, names)

    def __getitem__(self, name: str) -> TensorRef:
        try:
            return self.tensors[name]
        except KeyError:
            pass
        g = gguf_name(name, self.facts, self.config)
        what = f"GGUF tensor {g!r}" if g else "a tensor"
        raise CheckpointError(f"{what} is missing (sluice looked for {name!r}); the file is incomplete or not a "
                              f"{self.arch} model as llama.cpp writes it", file=str(self.folder), tensor=g or name)

    def __repr__(self) -> str:
        return (f"GGUFIndex({str(self.folder)!r}, arch={self.arch!r}, tensors={len(self.tensors)}, "
                f"files={len(self.files)}, bytes={self.total_bytes()})")


def _map_tensors(raw: dict[str, TensorRef], facts: GGUFArch, config: dict, blocks: int, file: str
                 ) -> tuple[dict[str, TensorRef], dict[str, str]]:
    """HF name -> TensorRef (GGUF name kept as ref.name; `ref.values` set where the converter mapped the values),
    and HF name -> GGUF name. The blocks after the model's layers (up to `blocks`, block_count: a multi-token-
    prediction head) stay listed under their GGUF names, never read."""
    arch, model_type = facts.name, config["model_type"]
    n_layers = config["num_hidden_layers"]
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    tensors: dict[str, TensorRef] = {}
    names: dict[str, str] = {}
    glob = {**_GLOBAL, **facts.global_tensors(config)}
    for gname, ref in raw.items():
        hname = hf_name(gname, facts, n_layers, config)
        m = _BLK_RE.fullmatch(gname)
        if hname is None and m and n_layers <= int(m["layer"]) < blocks and str(int(m["layer"])) == m["layer"]:
            tensors[gname], names[gname] = ref, gname  # the mtp head: its bytes are the file's, nothing reads them
            continue
        if hname is None:
            hint = _ROPE_FREQS_HINT if gname == "rope_freqs.weight" else \
                _OLD_EXPERTS_HINT if m and _OLD_EXPERTS.fullmatch(m["rest"]) else None
            known = ", ".join(sorted(facts.tensors))
            raise CheckpointError(
                f"is not part of a {arch} model ({model_type}) with {n_layers} layers as llama.cpp and sluice run it; "
                + (hint or f"known: {', '.join(glob)} and blk.N.{{{known}}}"), file=file, tensor=gname)
        proj = hname.rsplit(".", 2)[-2]
        if facts.rope_permuted and proj in heads and hname.endswith(".weight"):
            ref = _rope_permuted(ref, heads[proj], file)
        if facts.values_of(hname):
            ref = dataclasses.replace(ref, values=facts.values_of(hname))
        tensors[hname] = ref
        names[hname] = gname
    return tensors, names


def _rope_permuted(ref: TensorRef, heads: int, file: str) -> TensorRef:
    rows = ref.shape[0]
    if len(ref.shape) != 2 or rows % (2 * heads):
        raise CheckpointError(f"shape {list(ref.shape)} is not {heads} heads of an even head size; the file is "
                              "malformed", file=file, tensor=ref.name)
    return dataclasses.replace(ref, rope_heads=heads)
