"""Qwen4-Exp (`model_type: qwen4_exp`, Qwen3.8-Flash-Next; llama.cpp `qwen4exp`): Qwen3.5's hybrid (models/
qwen3_5_moe.py: Gated DeltaNet layers with four input projections, gated full attention, a softmax top-k MoE with a
sigmoid-gated shared expert, zero-centred norms) with three additions, each a module of models/layers/:

- hyper-connections (hyper.py): the residual is `hc_count` streams; each layer's `attn_hyper_connection` and
  `mlp_hyper_connection` mix them into the block input and inject its output back; `hyper_connection_mixer` mixes
  them for the head. There is no input / post-attention / final norm: the mixers' grouped norms take their place.
- QSA indexed attention (qsa.py) on the attending layers (`indexed_attention`; the hub's configs say
  `full_attention`), when the `indexer_*` fields are set (all of them; without them plain gated attention).
- PLE (ple.py) on the layers `ple_layer_ids` lists (1-based, Gated DeltaNet layers only): hashed n-gram embeddings
  from a per-layer table of tens of GiB, read by rows (store/rows.py RowTable; the `ple` load option), the hub's
  split into `split_ngram_parts` shards (models/tables.py).

The Gated DeltaNet's output gate is `output_gate_type` (sigmoid or silu; default hidden_act). A GGUF as llama.cpp's
converter writes it (`qwen4exp`: the table as per_layer_token_embd, F32 or any type sluice dequantizes, the hash's
numbers in its metadata) reads through the GGUF facts at the end of this file. The hub ships the model
as the multimodal wrapper (qwen3_5_moe's: text_config, model.language_model.*, a vision tower). Checkpoint names
under `model.layers.N.` beyond Qwen3.5's: `{attn,mlp}_hyper_connection.{hc_norm, input_mix_weight_down,
input_mix_weight_up, block_inject_weight}`, `self_attn.indexer.{index_qk_proj, q_layernorm, k_layernorm}`,
`ple.{key_proj, value_proj, norm_key, norm_query, norm_conv, conv1d}` and `ple.ple_embedding.ngram_embedding.*`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..checkpoint.gguf_config import ints
from ..checkpoint.multimodal import TEXT_PREFIX
from ..errors import CheckpointError, ConfigError
from . import ngram
from .arch import GGUFArch, SynthDefaults, SynthWrap, TensorName
from .args import CONFIG, MAX_HEAD_DIM
from .layers import Build, GatedAttention, GatedDeltaNet, HyperLayer, IndexedAttention, PLE, moe_or_dense
from .qwen3_5_moe import VISION_TOKENS, vision_tower
from .qwen3_next import (GGUF_HYBRID, GGUF_HYBRID_VALUES, HybridArgs, hybrid_gguf_config, hybrid_synth_config,
                         hybrid_tensors)
from .schema import cfg
from .spec import PLESpec, QSASpec, Spec

MODEL_TYPE = "qwen4_exp"
MOE_PREFIXES = ("mlp",)
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")
ROUTER = "gate"  # the router is `{prefix}.gate.weight` (store/layout.py moe_prefix)
MLX_MOE = "mlp"  # mlx-lm's name of the MoE block (tools/mlx_export.py)
MLX_VALUES: dict[str, str] = {}  # mlx-lm has no qwen4_exp: no converter values to undo
synth_experts = synth_expert_nbytes = None  # make-model writes the per-expert / fused layouts
expert_layer = None  # store/layout.py reads the per-expert, fused or stacked expert layouts
INTERMEDIATE_KEY = "moe_intermediate_size"
LAYER_TYPES = ("linear_attention", "full_attention", "indexed_attention")
QSA_FIELDS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
HASH_FIELDS = ("ple_multipliers", "ple_head_sizes", "ple_head_offsets", "ple_table_rows")  # a GGUF's (ModelArgs)
#: n-gram heads over all PLE layers: each is a prime to find (~0.4 ms near 2^31), so a hostile config stays cheap;
#: the real model has 16
MAX_NGRAM_HEADS = 4096
TABLE = "model.layers.{layer}.ple.ple_embedding"
# the hash's buffers transformers saves beside the table (PLESpec.hashes: checked at load where present)
HASHES = {"multipliers": f"{TABLE}.layer_multipliers", "sizes": f"{TABLE}.ngram_heads_vocab_sizes",
          "offsets": f"{TABLE}.ngram_heads_offsets"}


@dataclass(kw_only=True)
class ModelArgs(HybridArgs):
    """Qwen3.5's hybrid fields (HybridArgs) and Qwen4-Exp's (defaults: transformers')."""

    layer_types: list[str] | None = cfg(None, choices=LAYER_TYPES, length="num_hidden_layers")
    norm_topk_prob: bool = cfg(True)
    output_gate_type: str | None = cfg(None, choices=("silu", "sigmoid"))  # null: hidden_act
    hc_count: int = cfg(4, ge=2, le=64)
    hc_lowrank: int = cfg(320, ge=1)
    ple_layer_ids: list[int] | None = cfg(None, ge=1, le="num_hidden_layers")  # 1-based
    ple_embed_dim: int | None = cfg(None, ge=1)  # null: hidden_size
    ple_conv_kernel_size: int = cfg(4, ge=1, le=64)
    ngram_size: int = cfg(3, ge=1, le=64)
    heads_per_ngram: int = cfg(8, ge=1, le=MAX_NGRAM_HEADS)
    ngram_vocab_size_base: int = cfg(20_000_000, ge=1)
    make_ngram_vocab_size_divisible_by: int = cfg(128, ge=1)
    seed: int = cfg(1234, ge=0)
    split_ngram_parts: int = cfg(512, ge=1)  # how the hub splits a table; reading takes whatever parts are there
    indexer_n_heads: int | None = cfg(None, ge=1)
    indexer_kv_heads: int | None = cfg(None, ge=1)
    indexer_head_dim: int | None = cfg(None, ge=1, le=MAX_HEAD_DIM)
    indexer_budget: int | None = cfg(None, ge=1)
    indexer_compress_ratio: int | None = cfg(None, ge=1)
    # sluice's own keys, not transformers': what a GGUF states (the GGUF facts below; a Hugging Face folder keeps the
    # defaults). The indexer's projection stored as two (llama.cpp's indexer.q_proj, indexer.k_proj):
    indexer_qk_split: bool = cfg(False)
    # the hash of the one PLE layer a GGUF has, as its numbers (llama.cpp's converter writes them, not the seed and
    # base they come from), and the table's rows as stored; null: computed from the fields above (models/ngram.py)
    ple_multipliers: list[int] | None = cfg(None, ge=1, le=ngram.MAX_LONG)
    ple_head_sizes: list[int] | None = cfg(None, ge=1)
    ple_head_offsets: list[int] | None = cfg(None, ge=0)
    ple_table_rows: int | None = cfg(None, ge=1)
    ple_eos_token_id: int | None = cfg(None, ge=0)  # where n-grams restart (null: eos_token_id, its first)

    @classmethod
    def from_dict(cls, config: dict, source: str | os.PathLike[str] = CONFIG):
        """HybridArgs.from_dict, then what needs the rope: the indexer's heads are roped like the attention's (its
        rotary dims must fit in indexer_head_dim)."""
        args = super().from_dict(config, source)
        rot = int(args.head_dim * args.rope.partial_rotary_factor)
        if args.indexer_head_dim is not None and rot > args.indexer_head_dim:
            raise ConfigError(f"got {args.indexer_head_dim}; the indexer's heads are roped like the attention's "
                              f"{rot} rotary dims: expected at least {rot}", file=str(source),
                              field="indexer_head_dim")
        return args

    def __post_init__(self):
        super().__post_init__()
        self.ple_layer_ids = sorted(set(self.ple_layer_ids or []))  # as transformers reads them
        self.ple_embed_dim = self.ple_embed_dim or self.hidden_size

    def config_problems(self) -> Iterator[tuple[str, str]]:
        yield from super().config_problems()
        gate = self.output_gate_type or self.hidden_act
        if gate not in ("silu", "sigmoid"):
            yield "output_gate_type", (f"missing, and hidden_act {self.hidden_act!r} is no Gated DeltaNet output "
                                       "gate: expected \"sigmoid\" or \"silu\"")
        yield from self._qsa_problems()
        yield from self._ple_problems()

    def _qsa_problems(self) -> Iterator[tuple[str, str]]:
        given = [f for f in QSA_FIELDS if getattr(self, f) is not None]
        if not given:
            return
        missing = [f for f in QSA_FIELDS if getattr(self, f) is None]
        if missing:
            yield missing[0], f"missing: QSA needs all of {', '.join(QSA_FIELDS)} once one is set ({given[0]} is)"
        elif self.indexer_kv_heads != 1:
            yield "indexer_kv_heads", f"got {self.indexer_kv_heads}; Qwen4-Exp's QSA has one key head: expected 1"
        elif self.indexer_budget % self.indexer_compress_ratio:
            yield "indexer_budget", (f"got {self.indexer_budget}; expected a multiple of indexer_compress_ratio "
                                     f"({self.indexer_compress_ratio}): the budget is whole blocks")

    def _ple_problems(self) -> Iterator[tuple[str, str]]:
        ids = self.ple_layer_ids
        if not ids:
            return
        heads = (self.ngram_size - 1) * self.heads_per_ngram
        if heads < 1 or self.ple_embed_dim % heads:
            yield "ple_embed_dim", (f"got {self.ple_embed_dim}; expected a multiple of the n-gram heads, "
                                    f"(ngram_size - 1) x heads_per_ngram = {heads}, of which there must be at least 1")
        elif heads * len(ids) > MAX_NGRAM_HEADS:
            yield "heads_per_ngram", (f"{heads} n-gram heads on {len(ids)} PLE layers: expected at most "
                                      f"{MAX_NGRAM_HEADS} in all")
        elif not_linear := [i for i in ids if not self.linear_layers()[i - 1]]:
            yield "ple_layer_ids", (f"layers {not_linear} are not linear_attention layers; Qwen4-Exp's PLE runs only "
                                    "on linear_attention layers")
        elif (self.eos_token_id is None or self.eos_token_id == []) and self.ple_eos_token_id is None:
            yield "eos_token_id", "missing; PLE's n-grams restart after the end-of-sequence token: expected its id"
        else:
            yield from self._hash_problems()

    def _hash_problems(self) -> Iterator[tuple[str, str]]:
        """The numbers a GGUF gives instead of the seed and base: all or none, for one PLE layer, the right counts,
        products t * m (t < vocab_size) within int64 as the hash computes them, every head inside the table."""
        given = [f for f in HASH_FIELDS if getattr(self, f) is not None]
        if not given:
            return
        heads = (self.ngram_size - 1) * self.heads_per_ngram
        sizes, offsets, rows = self.ple_head_sizes, self.ple_head_offsets, self.ple_table_rows
        if missing := [f for f in HASH_FIELDS if getattr(self, f) is None]:
            yield missing[0], f"missing: the hash's numbers are all of {', '.join(HASH_FIELDS)} once one is set"
        elif len(self.ple_layer_ids) != 1:
            yield "ple_layer_ids", (f"{self.ple_layer_ids}: the hash's numbers ({given[0]}) describe one PLE layer: "
                                    "expected one")
        elif len(self.ple_multipliers) != self.ngram_size:
            yield "ple_multipliers", f"{len(self.ple_multipliers)} of them: expected ngram_size = {self.ngram_size}"
        elif len(sizes) != heads or len(offsets) != heads:
            yield "ple_head_sizes", (f"{len(sizes)} sizes and {len(offsets)} offsets: expected one each per n-gram "
                                     f"head, (ngram_size - 1) x heads_per_ngram = {heads}")
        elif max(self.ple_multipliers) > ngram.MAX_LONG // self.vocab_size:
            yield "ple_multipliers", (f"{max(self.ple_multipliers)} times a token id below vocab_size "
                                      f"{self.vocab_size} leaves int64: expected at most "
                                      f"{ngram.MAX_LONG // self.vocab_size}")
        elif bad := [h for h in range(heads) if offsets[h] + sizes[h] > rows]:
            yield "ple_table_rows", (f"{rows}: head {bad[0]} takes rows {offsets[bad[0]]} .. "
                                     f"{offsets[bad[0]] + sizes[bad[0]] - 1}: expected the table to hold every head")

    def spec(self) -> Spec:
        s = self.hybrid_spec(norm_topk_prob=self.norm_topk_prob, hc_count=self.hc_count, hc_lowrank=self.hc_lowrank,
                             final_norm=False, qsa=self._qsa(), ple=self._ple())
        s.delta = dataclasses.replace(s.delta, gate_act=self.output_gate_type or self.hidden_act)
        return s

    def _qsa(self) -> QSASpec | None:
        if self.indexer_n_heads is None:
            return None
        return QSASpec(n_heads=self.indexer_n_heads, head_dim=self.indexer_head_dim, budget=self.indexer_budget,
                       compress_ratio=self.indexer_compress_ratio, split=self.indexer_qk_split)

    def _ple(self) -> PLESpec | None:
        ids = self.ple_layer_ids
        if not ids:
            return None
        eos = self.ple_eos_token_id
        if eos is None:
            eos = self.eos_token_id[0] if isinstance(self.eos_token_id, list) else self.eos_token_id
        if self.ple_multipliers is not None:  # a GGUF's numbers, for its one PLE layer (_hash_problems)
            sizes, offsets, mult = [self.ple_head_sizes], [self.ple_head_offsets], [self.ple_multipliers]
            rows = [self.ple_table_rows]
        else:
            heads = (self.ngram_size - 1) * self.heads_per_ngram
            sizes = ngram.head_sizes(self.ngram_vocab_size_base, heads, len(ids))
            offsets = [ngram.offsets(h) for h in sizes]
            mult = [ngram.multipliers(self.vocab_size, self.ngram_size, i, self.seed) for i in range(len(ids))]
            rows = [ngram.padded_rows(h, self.make_ngram_vocab_size_divisible_by) for h in sizes]
        return PLESpec(
            layers=[i - 1 for i in ids], ngram_size=self.ngram_size, heads_per_ngram=self.heads_per_ngram,
            embed_dim=self.ple_embed_dim, conv_kernel=self.ple_conv_kernel_size, eos_token_id=eos, head_sizes=sizes,
            offsets=offsets, multipliers=mult, rows=rows, table=f"{TABLE}.ngram_embedding", hashes=dict(HASHES))


# -- tensor names ----------------------------------------------------------------------------------------------------
def hyper_tensors(role: str, prefix: str, spec: Spec, inject: bool = True) -> list[TensorName]:
    """One hyper-connection's tensors under `prefix` (roles `{role}.norm`, ...): the streams' norm (zero-centred,
    drawn like a bias), the low-rank mixer, the inject weights."""
    nH, r = spec.hc_count * spec.hidden_size, spec.hc_lowrank
    out = [TensorName(f"{role}.norm", f"{prefix}.hc_norm.weight", (nH,), "bias"),
           TensorName(f"{role}.down", f"{prefix}.input_mix_weight_down.weight", (r, nH), "proj"),
           TensorName(f"{role}.up", f"{prefix}.input_mix_weight_up.weight", (nH, r), "proj")]
    if inject:
        out.append(TensorName(f"{role}.inject", f"{prefix}.block_inject_weight.weight", (spec.hc_count, nH), "proj"))
    return out


def layer_tensors(spec: Spec, layer: int, moe: str | None) -> list[TensorName]:
    """Qwen3.5's layer without its input / post-attention norms, plus the hyper-connections, the indexer on an
    attending layer (with QSA) and the PLE block's resident tensors on a PLE layer (its table: models/tables.py)."""
    s, p = spec, f"model.layers.{layer}"
    nH, E = s.hc_count * s.hidden_size, 0 if s.ple is None else s.ple.embed_dim
    out = hyper_tensors("hc_attn", f"{p}.attn_hyper_connection", s)
    if s.ple is not None and layer in s.ple.layers:
        out += [TensorName("ple.key", f"{p}.ple.key_proj.weight", (nH, E), "proj"),
                TensorName("ple.value", f"{p}.ple.value_proj.weight", (s.hidden_size, E), "proj"),
                *(TensorName(f"ple.{n}", f"{p}.ple.{n}.weight", (nH,), "bias")
                  for n in ("norm_key", "norm_query", "norm_conv")),
                TensorName("ple.conv", f"{p}.ple.conv1d.weight", (nH, 1, s.ple.conv_kernel), "proj")]
    out += [t for t in hybrid_tensors(s, layer, moe) if t.role not in ("input_norm", "post_norm")]
    if s.attends(layer) and s.qsa is not None:
        a, q, H = f"{p}.self_attn.indexer", s.qsa, s.hidden_size
        if q.split:  # a GGUF's (models/qwen4_exp.py GGUF: indexer.q_proj, indexer.k_proj)
            out += [TensorName("indexer.q", f"{a}.q_proj.weight", (q.n_heads * q.head_dim, H), "proj"),
                    TensorName("indexer.k", f"{a}.k_proj.weight", (q.head_dim, H), "proj")]
        else:
            out.append(TensorName("indexer.qk", f"{a}.index_qk_proj.weight", ((q.n_heads + 1) * q.head_dim, H),
                                  "proj"))
        out += [TensorName("indexer.q_norm", f"{a}.q_layernorm.weight", (q.head_dim,), "bias"),
                TensorName("indexer.k_norm", f"{a}.k_layernorm.weight", (q.head_dim,), "bias")]
    return out + hyper_tensors("hc_mlp", f"{p}.mlp_hyper_connection", s)


def final_tensors(spec: Spec) -> list[TensorName]:
    """No final norm: the hyper-connections' final mixer (models/arch.py final_tensors)."""
    return hyper_tensors("hc_mixer", "model.hyper_connection_mixer", spec, inject=False)


def layers(b: Build) -> list[HyperLayer]:
    """Hyper-connection layers of Gated DeltaNet (with a PLE block first on the ple_layer_ids) or gated attention
    (QSA when configured), each with the softmax-routed MoE block and its sigmoid-gated shared expert."""
    s, out = b.spec, []
    for L in range(s.n_layers):
        if s.attends(L):
            mixer = IndexedAttention(b, L) if s.qsa is not None else GatedAttention(b, L)
        else:
            mixer = GatedDeltaNet(b, L)
        ple = PLE(b, L) if s.ple is not None and L in s.ple.layers else None
        out.append(HyperLayer(b, L, mixer, moe_or_dense(b, L), ple))
    return out


# -- synthetic checkpoints (tools/synth.py) --------------------------------------------------------------------------
# transformers' Qwen4ExpTextConfig defaults: 512 experts top-10, a shared expert, 4 streams; one PLE layer (llama.cpp's
# converter writes one table) of 16 heads (trigrams and bigrams, 8 each); QSA over blocks of 16 with a 1,024-token
# budget
SYNTH = SynthDefaults("Qwen4ExpForConditionalGeneration", num_experts=512, top_k=10, rope_theta=1e7,
                      rms_norm_eps=1e-6, shared_expert=True, ngram_table=True)
NGRAM_HEADS = 16  # (ngram_size 3 - 1) x 8 heads per order, transformers' defaults
SMALL_TABLE_BASE = 1024  # without --ple-size: primes from 1024, ~16k rows
PART_BYTES = 16 * 2**20  # a synthetic table's parts: 16 MiB, at least 4, at most 512 (the hub's split)


def _table_base(sc) -> int:
    """ngram_vocab_size_base that gives a table of about sc.ple_bytes (each head's part is a prime >= base)."""
    if not sc.ple_bytes:
        return SMALL_TABLE_BASE
    return max(2, round(sc.ple_bytes / (sc.itemsize * (sc.hidden_size // NGRAM_HEADS) * NGRAM_HEADS)))


def synth_config(sc) -> dict[str, Any]:
    """config.json keys of a synthetic Qwen4-Exp text model: the hybrid's (models/qwen3_next.py), 4 streams of rank
    5/32 of the hidden size (2048 -> transformers' 320), PLE on the first layer, QSA on the attending ones."""
    if sc.num_layers < 2:
        raise ConfigError("num_layers: qwen4_exp's PLE block sits on a Gated DeltaNet layer: expected at least 2 "
                          "layers (one of them attends)")
    if sc.hidden_size % NGRAM_HEADS:
        raise ConfigError(f"hidden_size: the n-gram table's {NGRAM_HEADS} heads split it: expected a multiple of "
                          f"{NGRAM_HEADS}, got {sc.hidden_size}")
    out = {**hybrid_synth_config(sc), "norm_topk_prob": True, "hc_count": 4,
           "hc_lowrank": max(1, 5 * sc.hidden_size // 32), "output_gate_type": "sigmoid", "ple_layer_ids": [1],
           "ple_conv_kernel_size": 4, "ngram_size": 3, "heads_per_ngram": NGRAM_HEADS // 2,
           "ngram_vocab_size_base": _table_base(sc), "make_ngram_vocab_size_divisible_by": 128, "seed": 1234,
           "indexer_n_heads": sc.num_heads, "indexer_kv_heads": 1, "indexer_head_dim": sc.head_dim,
           "indexer_budget": 1024, "indexer_compress_ratio": 16}
    out["split_ngram_parts"] = _parts(sc, out)
    return out


def _table_rows(cfg: dict) -> int:
    return ngram.padded_rows(ngram.head_sizes(cfg["ngram_vocab_size_base"], NGRAM_HEADS, 1)[0],
                             cfg["make_ngram_vocab_size_divisible_by"])


def _parts(sc, cfg: dict) -> int:
    return min(512, max(4, _table_rows(cfg) * (sc.hidden_size // NGRAM_HEADS) * sc.itemsize // PART_BYTES))


def table_tensors(spec: Spec, parts: int) -> list[TensorName]:
    """The PLE tables as the hub ships them: torch.chunk's split of each into `parts` shards (ceil(rows / parts)
    rows each, fewer in the last), under the multimodal wrapper's prefix; role "table" (SynthWrap)."""
    p, out = spec.ple, []
    for i, L in enumerate(p.layers):
        rows, name = p.rows[i], p.table.format(layer=L).replace("model.", TEXT_PREFIX, 1)
        step = -(-rows // parts)
        out += [TensorName("table", f"{name}.shard_{k}.weight", (min(rows, (k + 1) * step) - k * step, p.head_dim),
                           "embed") for k in range(-(-rows // step))]
    return out


def hash_tensors(spec: Spec) -> list[tuple[str, torch.Tensor]]:
    """The hash buffers transformers saves beside each table (int64), under the wrapper's prefix."""
    p, out = spec.ple, []
    for i, L in enumerate(p.layers):
        for role, values in (("multipliers", p.multipliers[i]), ("sizes", p.head_sizes[i]),
                             ("offsets", p.offsets[i])):
            out.append((p.hashes[role].format(layer=L).replace("model.", TEXT_PREFIX, 1),
                        torch.tensor(values, dtype=torch.int64)))
    return out


def synth_wrap(sc, spec: Spec, config: dict) -> SynthWrap:
    """The hub's multimodal wrapper (qwen3_5_moe's: text_config, a vision tower, the text model under
    model.language_model.*), the n-gram tables in shards and their hash buffers."""
    meta = ("architectures", "torch_dtype", "dtype")
    text = {k: v for k, v in config.items() if k not in meta}
    text["model_type"] = "qwen4_exp_text"
    vision, visual = vision_tower(64, spec.hidden_size)
    vision["model_type"] = "qwen4_exp_vision"
    wrapped = {"architectures": [SYNTH.hf_class], "model_type": MODEL_TYPE, "text_config": text,
               "vision_config": vision, "tie_word_embeddings": config["tie_word_embeddings"], **VISION_TOKENS,
               **{k: config[k] for k in meta[1:]}}
    return SynthWrap(wrapped, prefix=TEXT_PREFIX, extra=[*visual, *table_tensors(spec, config["split_ngram_parts"])],
                     fixed=hash_tensors(spec))


# -- GGUF (checkpoint/gguf_config.py) --------------------------------------------------------------------------------
# What llama.cpp's converter (conversion/qwen4exp.py, on top of its Qwen3.5 one: tiled value heads, -exp(A_log),
# squeezed convs, the zero-centred norms stored as 1 + w, qwen3_5_moe.py) does to the model, undone here:
#   hyper-connections              blk.N.hc_{attn,ffn}_{norm,down,up,inject}, output_hc_{norm,down,up} (norms + 1)
#   the indexer                    index_qk_proj split into indexer.q_proj | indexer.k_proj (indexer_qk_split), its
#                                  norms + 1; the compress ratio per layer in attention.compress_ratios, the budget
#                                  in attention.indexer.top_k
#   the PLE block                  blk.N.ple_{key,value,norm_key,norm_query,norm_conv,conv1d} (norms + 1, the conv
#                                  squeezed to [C, K]); its one table, the shards concatenated, as the global
#                                  per_layer_token_embd (F32 from the converter; llama-quantize may store it in any
#                                  type), row width embedding_length_per_layer_input; the hash's numbers in metadata
#                                  (ple.layer_multipliers, ple.head_vocab_sizes, ple.head_offsets, ple.eos_token_id)
# A converter reading config.json through transformers 5 (which renames the hub's "full_attention" layers
# "indexed_attention") never matches its own `== "full_attention"` test and writes compress ratio 0 everywhere;
# llama.cpp then runs those layers as dense gated attention, and so does sluice (no QSA: the indexer stays unread).
GGUF_TABLE = "per_layer_token_embd.weight"
_HC = {f"hc_{g}_{part}.weight": f"{h}_hyper_connection.{name}.weight" for g, h in (("attn", "attn"), ("ffn", "mlp"))
       for part, name in (("norm", "hc_norm"), ("down", "input_mix_weight_down"), ("up", "input_mix_weight_up"),
                          ("inject", "block_inject_weight"))}
GGUF_TENSORS = {
    **{g: h for g, h in GGUF_HYBRID.items() if h not in ("input_layernorm.weight", "post_attention_layernorm.weight")},
    "ssm_beta.weight": "linear_attn.in_proj_b.weight", "ssm_alpha.weight": "linear_attn.in_proj_a.weight", **_HC,
    **{f"indexer.{k}_proj.weight": f"self_attn.indexer.{k}_proj.weight" for k in "qk"},
    **{f"indexer.{k}_norm.weight": f"self_attn.indexer.{k}_layernorm.weight" for k in "qk"},
    "ple_key.weight": "ple.key_proj.weight", "ple_value.weight": "ple.value_proj.weight",
    **{f"ple_{n}.weight": f"ple.{n}.weight" for n in ("norm_key", "norm_query", "norm_conv")},
    "ple_conv1d.weight": "ple.conv1d.weight",  # [C, K]: read as [C, 1, K]
}
GGUF_VALUES = {**GGUF_HYBRID_VALUES, **{n: "plus_one" for n in (
    "hc_norm.weight", "ple.norm_key.weight", "ple.norm_query.weight", "ple.norm_conv.weight",
    "indexer.q_layernorm.weight", "indexer.k_layernorm.weight")}}


def _gguf_globals(config) -> dict[str, str]:
    out = {f"output_hc_{g}.weight": f"model.hyper_connection_mixer.{h}.weight"
           for g, h in (("norm", "hc_norm"), ("down", "input_mix_weight_down"), ("up", "input_mix_weight_up"))}
    if config.get("ple_layer_ids"):  # the table belongs to the one PLE layer
        out[GGUF_TABLE] = TABLE.format(layer=config["ple_layer_ids"][0] - 1) + ".ngram_embedding.weight"
    return out


def _gguf_config(m, tensors) -> dict[str, Any]:
    """llama.cpp's qwen4exp loader's keys: the hybrid's, the hyper-connections', QSA's where its ratio is set, PLE's
    where ple.layers is; its graph's fixed choices (sigmoid output gate, renormalised top-k)."""
    out = {**hybrid_gguf_config(m, tensors), "linear_value_head_order": "tiled", "output_gate_type": "sigmoid",
           "norm_topk_prob": True, "hc_count": m.int("hyper_connection.count", minimum=2),
           "hc_lowrank": m.int("hyper_connection.low_rank")}
    return {**out, **_gguf_qsa(m, out["layer_types"]), **_gguf_ple(m, tensors)}


def _gguf_qsa(m, types: list[str]) -> dict[str, Any]:
    ratios = ints(m, "attention.compress_ratios", len(types), default=[0] * len(types), per_layer=True)
    used = {ratios[i] for i, t in enumerate(types) if t != "linear_attention"}
    if used <= {0}:  # dense attention, as llama.cpp runs a layer whose ratio is 0
        return {}
    if len(used) > 1 or 0 in used:
        raise ConfigError(f"{m.file}: metadata {m.key('attention.compress_ratios')} is {ratios}: sluice runs one "
                          "compress ratio on every attention layer (or none: all 0)")
    return dict(indexer_n_heads=m.int("attention.indexer.head_count"), indexer_kv_heads=1,
                indexer_head_dim=m.int("attention.indexer.key_length"), indexer_budget=m.int("attention.indexer.top_k"),
                indexer_compress_ratio=used.pop(), indexer_qk_split=True)


def _gguf_ple(m, tensors) -> dict[str, Any]:
    if not m.has("ple.layers"):
        return {"ple_layer_ids": []}
    layers, key = ints(m, "ple.layers"), m.key("ple.layers")
    if len(layers) != 1:
        raise ConfigError(f"{m.file}: metadata {key} is {layers[:8]}: a qwen4exp GGUF holds one n-gram table "
                          f"({GGUF_TABLE}), for one PLE layer (llama.cpp reads no more)")
    table = tensors.get(GGUF_TABLE)
    width = m.int("embedding_length_per_layer_input")
    if table is None or len(table.shape) != 2 or table.shape[1] != width:
        got = "missing" if table is None else f"of shape {list(table.shape)}"
        raise CheckpointError(f"{got}; metadata {key} puts the n-gram table (PLE) on layer {layers[0]}: expected "
                              f"[rows, {m.key('embedding_length_per_layer_input')} = {width}]", file=m.file,
                              tensor=GGUF_TABLE)
    n, per = m.int("ple.ngram_size", minimum=2), m.int("ple.heads_per_ngram")
    heads = (n - 1) * per
    sizes, offsets = ints(m, "ple.head_vocab_sizes", heads), ints(m, "ple.head_offsets", heads)
    need = max(o + s for o, s in zip(offsets, sizes))
    if table.shape[0] < need:  # llama.cpp's loader refuses it too
        raise CheckpointError(f"has {table.shape[0]} rows, too few for the n-gram heads of metadata "
                              f"{m.key('ple.head_offsets')} / {m.key('ple.head_vocab_sizes')} ({need})", file=m.file,
                              tensor=GGUF_TABLE)
    return dict(ple_layer_ids=[layers[0] + 1], ngram_size=n, heads_per_ngram=per, ple_embed_dim=heads * width,
                ple_conv_kernel_size=m.int("ple.conv_kernel"), ple_eos_token_id=m.int("ple.eos_token_id", minimum=0),
                ple_multipliers=ints(m, "ple.layer_multipliers", n), ple_head_sizes=sizes, ple_head_offsets=offsets,
                ple_table_rows=table.shape[0])


GGUF = GGUFArch("qwen4exp", tensors=GGUF_TENSORS, config=_gguf_config, norm_topk_prob=True, values=GGUF_VALUES,
                partial_rope=True, other_tensors=_gguf_globals)
