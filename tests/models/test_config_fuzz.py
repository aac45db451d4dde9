"""Seeded fuzz of config.json validation: thousands of mutated configs of every architecture (wrong types, missing
keys, extreme values, rope variants). Only SluiceError subclasses may escape; every accepted config builds a Spec
whose invariants hold, and a sample of them runs a tiny random model to finite logits.

No weights are read: each config is validated and reduced to its Spec (a few thousand in ~2 s).
"""

from __future__ import annotations

import copy
import json
import math
import random
import traceback

import torch

from sluice.errors import ConfigError, SluiceError
from sluice.models import model_args, supported
from sluice.models.args import ACTIVATIONS
from sluice.models.layers import Build
from sluice.models.model import Transformer
from sluice.models.spec import (DeltaNetWeights, HyperWeights, IndexerWeights, KVCache, LayerWeights, MLAWeights,
                                MLPWeights, PLEWeights, Spec, Weights)
from sluice.models.rope import inv_freq
from sluice.models.schema import MAX_INT, describe_fields
from sluice.quant.compute import Compute
from sluice.quant.spec import QuantSpec
from sluice.store.base import ExpertBatch
from sluice.store.layout import ExpertFormat

from .test_config import DEMO, transformers_saved
from .tiny import TINY

SEED = 20240612
N_CONFIGS = 3000
N_MATH = 40  # accepted configs small enough to run (tiny random weights, 3 tokens)
SRC = "/fuzz/config.json"

ROPE_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
             "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate")
NASTY = ["4", "false", "", "silu", 1.5, 4096.0, -0.0, 0.0, float("nan"), float("inf"), -float("inf"), 1e308, 1e-320,
         True, False, None, [], [1], ["full_attention"], [0, 1], {}, {"a": 1}, 2**31, 2**63, 2**64, 2**200, -2**63,
         -1, 0, 1, 2, 3, 4, 7, 8, 16, 64, 10**6]

EXTREME = [1e-320, 1e-30, 1e-3, 0.5, 1.0, 1.5, 1e3, 1e30, 1e308, 0, -1.0, 2**31 - 1]  # for rope numbers


def _bases() -> list[dict]:
    out = [dict(c) for c in TINY.values()]
    out += [transformers_saved(arch) for arch in sorted(TINY)]
    out.append(json.loads(DEMO.read_text()))
    return out


def _schema_keys() -> list[str]:
    keys: set[str] = set()
    for arch in supported():
        module = __import__(f"sluice.models.{arch}", fromlist=["ModelArgs"])
        keys.update(name for name, *_ in describe_fields(module.ModelArgs))
    return sorted(keys | {"num_local_experts", "rope_theta", "rope_scaling", "rope_parameters", "model_type"})


def _value(rng: random.Random, old=None):
    """A nasty value, or near the old one (off by one, doubled, halved) to reach the range and relation checks."""
    if isinstance(old, int) and not isinstance(old, bool) and rng.random() < 0.4:
        return rng.choice([old + 1, old - 1, old * 2, old // 2, -old, old * 2**40])
    if isinstance(old, float) and rng.random() < 0.4:
        return rng.choice([old * 10, old / 10, -old, 0.0, 1.0, old * 1e300])
    return copy.deepcopy(rng.choice(NASTY))


def _rope(rng: random.Random) -> object:
    """A rope dict: a real type (or not) with some keys, half of them sensible."""
    if rng.random() < 0.1:
        return _value(rng)
    sensible = {"factor": rng.choice([1.0, 2, 4.0, 40.0]), "original_max_position_embeddings": rng.choice([64, 128]),
                "low_freq_factor": 1.0, "high_freq_factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                "mscale": 1.0, "mscale_all_dim": rng.choice([0.0, 1.0]), "attention_factor": 1.2,
                "rope_theta": rng.choice([1e4, 5e5]), "partial_rotary_factor": rng.choice([0.5, 1.0]),
                "truncate": rng.random() < 0.5}
    kind = rng.choice(["default", "linear", "yarn", "yarn", "llama3", "llama3", "dynamic", "longrope", None, 3])
    out: dict = {"rope_type" if rng.random() < 0.8 else "type": kind}
    for key in rng.sample(ROPE_KEYS[2:], rng.randint(0, 6)):
        roll = rng.random()
        out[key] = sensible[key] if roll < 0.4 else rng.choice(EXTREME) if roll < 0.8 else _value(rng)
    if rng.random() < 0.05:
        out = {"full_attention": out, "sliding_attention": dict(out)}
    return out


def _mutate(rng: random.Random, base: dict, keys: list[str]) -> dict:
    cfg = copy.deepcopy(base)
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        key = rng.choice(sorted(set(cfg) | set(keys)))
        if op < 0.15:
            cfg.pop(key, None)
        elif op < 0.3:
            cfg[rng.choice(["rope_parameters", "rope_scaling"])] = _rope(rng)
        elif op < 0.4:
            n = cfg.get("num_hidden_layers", 3) if isinstance(cfg.get("num_hidden_layers"), int) else 3
            if rng.random() < 0.5:
                cfg["mlp_only_layers"] = rng.sample(range(-1, max(0, min(n, 8)) + 2), rng.randint(0, 3))
            else:
                kinds = ["full_attention", "sliding_attention"] + (["x"] if rng.random() < 0.2 else [])
                cfg["layer_types"] = [rng.choice(kinds) for _ in range(max(0, min(n, 8)) + rng.choice([-1, 0, 0, 1]))]
        else:
            cfg[key] = _value(rng, cfg.get(key))
    return cfg


def _check_spec(s: Spec) -> None:
    """What the math relies on, for an accepted config."""
    ints = (s.vocab_size, s.hidden_size, s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim, s.num_experts, s.top_k,
            s.moe_intermediate_size)
    assert all(type(v) is int and 1 <= v <= MAX_INT for v in ints), ints
    assert s.n_heads % s.n_kv_heads == 0 and s.top_k <= s.num_experts
    assert len(s.moe_layers) == len(s.sliding_window) == s.n_layers and any(s.moe_layers)
    assert all(s.moe_layers) or s.dense_intermediate_size >= 1
    assert all(w is None or (type(w) is int and w >= 1) for w in s.sliding_window)
    assert type(s.rms_norm_eps) is float and 0 < s.rms_norm_eps < 1
    assert type(s.tie_word_embeddings) is bool and type(s.norm_topk_prob) is bool and type(s.qkv_bias) is bool
    assert s.hidden_act in ACTIVATIONS
    assert s.clip_qkv is None or s.clip_qkv > 0
    assert type(s.rope.theta) is float and s.rope.theta > 1
    floats = [s.rms_norm_eps, s.rope.theta, s.rope.partial_rotary_factor, s.clip_qkv or 1.0]
    floats += [v for v in s.rope.params.values() if not isinstance(v, bool)]
    assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in floats), floats
    freq, scale = inv_freq(s.rope)
    assert torch.isfinite(freq).all() and 0 < scale <= 10
    assert 2 * freq.numel() <= s.head_dim
    if s.qsa is not None:  # the indexer's heads are roped like the attention's
        assert s.qsa.block_topk >= 1 and 2 * freq.numel() <= s.qsa.head_dim
    if s.ple is not None:  # every hashed row id lands in its table; token id x multiplier stays in int64
        p = s.ple
        assert p.layers and not any(s.attends(L) for L in p.layers) and p.embed_dim % p.n_heads == 0
        assert all(offs[-1] + sizes[-1] <= rows for sizes, offs, rows in zip(p.head_sizes, p.offsets, p.rows))
        assert all(0 < m and m * s.vocab_size < 2**63 for ms in p.multipliers for m in ms)


def _small(s: Spec) -> bool:
    return (s.vocab_size <= 512 and s.hidden_size <= 128 and s.n_layers <= 4 and s.num_experts <= 16
            and s.n_heads * s.head_dim <= 256 and s.n_kv_heads * s.head_dim <= 256
            and max(s.moe_intermediate_size, s.dense_intermediate_size, s.shared_expert_intermediate_size) <= 128
            and (s.mla is None or s.n_heads * (s.mla.qk_head_dim + s.mla.v_head_dim) <= 512
                 and max(s.mla.q_lora_rank, s.mla.kv_lora_rank) <= 128)
            and s.hc_count * s.hidden_size <= 512 and s.hc_lowrank <= 128
            and (s.qsa is None or s.qsa.n_heads * s.qsa.head_dim <= 256)
            and (s.ple is None or max(s.ple.rows) <= 8192 and s.ple.embed_dim <= 256))


def _mla_weights(s: Spec, r) -> MLAWeights:
    """Random latent attention projections of spec `s` (models/layers/mla.py)."""
    m, H, nH = s.mla, s.hidden_size, s.n_heads
    w = MLAWeights(kv_a=r(m.cache_dim, H), kv_a_norm=1 + r(m.kv_lora_rank),
                   kv_b=r(nH * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank))
    if m.q_lora_rank:
        w.q_a, w.q_a_norm, w.q_b = r(m.q_lora_rank, H), 1 + r(m.q_lora_rank), r(nH * m.qk_head_dim, m.q_lora_rank)
    else:
        w.q = r(nH * m.qk_head_dim, H)
    return w


class _Table:
    """A PLE layer's n-gram table in memory (the RowTable seam: gather(ids) -> rows, no files)."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows[ids]


def _hyper(s: Spec, r, inject: bool = True) -> HyperWeights:
    """Random hyper-connection weights of spec `s` (models/layers/hyper.py)."""
    nH = s.hc_count * s.hidden_size
    return HyperWeights(norm=r(nH), down=r(s.hc_lowrank, nH), up=r(nH, s.hc_lowrank),
                        inject=r(s.hc_count, nH) if inject else None)


def _qwen4_exp_parts(s: Spec, lw: LayerWeights, L: int, r, tables: dict) -> None:
    """Hyper-connections, QSA's indexer and a PLE block with its table (models/layers/hyper.py, qsa.py, ple.py) on
    layer L of a spec that has them."""
    if s.hc_count > 1:
        lw.hc_attn, lw.hc_mlp = _hyper(s, r), _hyper(s, r)
    if s.qsa is not None and s.attends(L):
        q = s.qsa
        lw.indexer = IndexerWeights(qk=r((q.n_heads + 1) * q.head_dim, s.hidden_size), q_norm=r(q.head_dim),
                                    k_norm=r(q.head_dim))
    if s.ple is not None and L in s.ple.layers:
        p, nH = s.ple, s.hc_count * s.hidden_size
        lw.ple = PLEWeights(key=r(nH, p.embed_dim), value=r(s.hidden_size, p.embed_dim), norm_key=r(nH),
                            norm_query=r(nH), norm_conv=r(nH), conv=r(nH, 1, p.conv_kernel))
        tables[L] = _Table(r(p.rows[p.index(L)], p.head_dim, std=1.0))


class _Store:
    """All experts in memory as [E, 2I, H] / [E, H, I] stacks per MoE layer (the ExpertStore seam, no files)."""

    def __init__(self, stacks: dict[int, tuple[torch.Tensor, torch.Tensor]], max_batch: int, s: Spec):
        self.stacks, self.max_batch = stacks, max_batch
        H, Im = s.hidden_size, s.moe_intermediate_size
        fmt = ExpertFormat.of(QuantSpec.ggml("F32", Im, H), QuantSpec.ggml("F32", Im, H), QuantSpec.ggml("F32", H, Im))
        self.layout = _Layout(fmt, sorted(stacks))

    def acquire(self, layer, experts):
        gu, dn = self.stacks[layer]
        return ExpertBatch(gu, dn, list(experts))

    def release(self, layer):
        pass

    def prefetch(self, layer, experts):
        pass


class _Layout:
    """The store's layout as the MoE block reads it: every layer's experts in one plain format."""

    def __init__(self, fmt: ExpertFormat, layers: list[int]):
        self.fmt, self.layers = fmt, layers

    def format(self, layer: int) -> ExpertFormat:
        return self.fmt


def _run_tiny(arch, s: Spec, seed: int) -> torch.Tensor:
    """Final logits of a random model of spec `s` on 3 tokens (fewer if the context is shorter)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, std=0.1):
        return torch.randn(*shape, generator=g) * std

    H, D, nH, nKV, E, Im = s.hidden_size, s.head_dim, s.n_heads, s.n_kv_heads, s.num_experts, s.moe_intermediate_size
    layers, stacks, tables = [], {}, {}
    for L in range(s.n_layers):
        if s.mla is not None:
            lw = LayerWeights(input_norm=1 + r(H), post_norm=1 + r(H), o=r(H, nH * s.mla.v_head_dim),
                              mla=_mla_weights(s, r))
        elif not s.attends(L):  # a Gated DeltaNet layer (qwen3_next's fused projections)
            d = s.delta
            lw = LayerWeights(input_norm=r(H), post_norm=r(H), o=r(H, d.value_dim), delta=DeltaNetWeights(
                conv=r(d.conv_dim, 1, d.conv_kernel), A_log=r(d.n_v_heads), dt_bias=r(d.n_v_heads),
                norm=1 + r(d.v_head_dim), qkvz=r(2 * d.key_dim + 2 * d.value_dim, H), ba=r(2 * d.n_v_heads, H)))
        else:  # gated attention: q_proj gives queries and the gate
            q_rows = (2 if s.attn_gate else 1) * nH * D
            lw = LayerWeights(input_norm=1 + r(H), post_norm=1 + r(H), q=r(q_rows, H), k=r(nKV * D, H),
                              v=r(nKV * D, H), o=r(H, nH * D))
        if s.qkv_bias and lw.q is not None:
            lw.q_bias, lw.k_bias, lw.v_bias = r(lw.q.shape[0]), r(nKV * D), r(nKV * D)
        if s.o_bias:
            lw.o_bias = r(H)
        if s.qk_norm == "head" and lw.q is not None:
            lw.q_norm, lw.k_norm = 1 + r(D), 1 + r(D)
        elif s.qk_norm == "full":
            lw.q_norm, lw.k_norm = 1 + r(nH * D), 1 + r(nKV * D)
        if s.moe_layers[L]:
            lw.router = r(E, H)
            stacks[L] = (r(E, 2 * Im, H), r(E, H, Im))
            if s.shared_expert_intermediate_size:
                Is = s.shared_expert_intermediate_size
                lw.shared, lw.shared_gate = MLPWeights(r(Is, H), r(Is, H), r(H, Is)), r(1, H)
        else:
            Id = s.dense_intermediate_size
            lw.mlp = MLPWeights(r(Id, H), r(Id, H), r(H, Id))
        _qwen4_exp_parts(s, lw, L, r, tables)
        layers.append(lw)
    embed = r(s.vocab_size, H, std=1.0)
    weights = Weights(embed=embed, norm=1 + r(H), lm_head=embed if s.tie_word_embeddings else r(s.vocab_size, H),
                      layers=layers, hc_mixer=_hyper(s, r, inject=False) if s.hc_count > 1 else None)
    ctx = min(8, s.rope.max_position_embeddings)
    b = Build(s, weights, _Store(stacks, E, s), KVCache(s, ctx, torch.float32), Compute(torch.float32),
              tables=tables)
    model = Transformer(arch, b)
    T = min(3, ctx)
    tokens = torch.randint(0, s.vocab_size, (T,), generator=g)
    out = model.logits(model.forward(tokens, 0))  # prefill
    if T < ctx:
        out = model.logits(model.forward(tokens[:1], T))  # one decode step through the KV cache
    return out


def test_fuzzed_configs_give_clean_errors_or_sound_specs():
    # one thread: these shapes gain nothing from more, and on a busy 2-core machine spinning OpenMP threads made each
    # tiny model take ~1.5 s instead of ~30 ms (measured)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _fuzz()
    finally:
        torch.set_num_threads(threads)


def _fuzz() -> None:
    rng = random.Random(SEED)
    bases, keys = _bases(), _schema_keys()
    accepted, refused, ran = 0, 0, 0
    for i in range(N_CONFIGS):
        cfg = _mutate(rng, rng.choice(bases), keys)
        try:
            try:
                arch, args = model_args(cfg, SRC)
                spec = args.spec()
            except SluiceError as e:
                refused += 1
                assert isinstance(e, ConfigError) and e.file == SRC and e.field and str(e).startswith(f"file {SRC}")
                continue
            accepted += 1
            _check_spec(spec)
            if ran < N_MATH and _small(spec):
                assert torch.isfinite(_run_tiny(arch, spec, i)).all(), "non-finite logits"
                ran += 1
        except Exception:
            raise AssertionError(f"config #{i} (seed {SEED}):\n{json.dumps(cfg, default=str)[:2000]}\n"
                                 f"{traceback.format_exc()}") from None
    # the mutations reach both outcomes and the math often enough to mean something
    assert refused > N_CONFIGS // 4 and accepted > N_CONFIGS // 10 and ran == N_MATH, (accepted, refused, ran)
