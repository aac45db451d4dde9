"""gpt_oss with its experts in MXFP4 as shipped: logits and greedy tokens against transformers running the weights its
own `convert_moe_packed_tensors` dequantizes, streamed == resident bitwise, and the layout's errors.

The dequantized layout (`save_pretrained` of a dequantized model) runs through the shared runner (test_parity.py,
TINY["gpt_oss"]); this file covers what only the MXFP4 layout has.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import sluice
from sluice.errors import CheckpointError

from .test_parity import _prompt
from .tiny import hf_model

PROJ = ("gate_up_proj", "down_proj")


def mxfp4_checkpoint(folder: Path, dtype: torch.dtype, seed: int = 0, **overrides):
    """(folder, transformers model): the TINY gpt_oss (with config `overrides`) with random MXFP4 experts; the
    checkpoint stores them as `*_blocks` / `*_scales` (uint8), the reference model holds transformers' own
    dequantization of those bytes."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = hf_model("gpt_oss", torch.float32, seed=seed, **overrides)
    g = torch.Generator().manual_seed(seed + 100)
    packed = {}
    with torch.no_grad():
        for L, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            for name in PROJ:
                E, n_in, n_out = getattr(ex, name).shape  # [E, in, out] in the dequantized layout
                blocks = torch.randint(0, 256, (E, n_out, n_in // 32, 16), dtype=torch.uint8, generator=g)
                # 2^(s-127) with s in 120..123: weights ~N(0, 0.1)-sized like hf_model's other projections
                scales = torch.randint(120, 124, (E, n_out, n_in // 32), dtype=torch.uint8, generator=g)
                getattr(ex, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                packed[f"model.layers.{L}.mlp.experts.{name}_blocks"] = blocks
                packed[f"model.layers.{L}.mlp.experts.{name}_scales"] = scales
    model = model.to(dtype).eval()
    model.save_pretrained(folder)
    state = {k: v for k, v in load_file(folder / "model.safetensors").items()
             if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**state, **packed}, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, model


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    cache: dict = {}

    def get(dtype: torch.dtype = torch.float32):
        if dtype not in cache:
            cache[dtype] = mxfp4_checkpoint(tmp_path_factory.mktemp(f"gpt_oss-mxfp4-{str(dtype)[6:]}"), dtype)
        return cache[dtype]

    return get


def _ref_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_mxfp4_slots_hold_the_stored_bytes(mxfp4):
    folder, _ = mxfp4()
    with sluice.load(folder) as m:
        assert m.layout.format_names == ["mxfp4"]
        fmt = m.layout.format(0)
        H, I = m.spec.hidden_size, m.spec.moe_intermediate_size
        # 4.25 bits per weight plus the float32 biases, read as stored (the slot adds alignment padding only)
        assert sum(p.range.nbytes for p in m.layout.parts(0, 3)) == 3 * H * I * 17 // 32 + (2 * I + H) * 4
        assert fmt.stored_nbytes == 3 * H * I * 17 // 32 + (2 * I + H) * 4
        assert fmt.nbytes == m.layout.expert_nbytes < 3 * H * I * 4


def test_mxfp4_logits_match_transformers_fp32(mxfp4):
    folder, ref_model = mxfp4()
    ids = _prompt()  # 24 tokens: past the sliding window (8) of layers 0 and 2
    ref = _ref_logits(ref_model, ids)
    with sluice.load(folder) as m:
        assert m.dtype == torch.float32
        out = m.logits(ids)
    assert (out - ref).abs().max().item() <= 1e-4


def test_mxfp4_logits_bf16_within_twice_transformers_own_error(mxfp4):
    _, ref32 = mxfp4()
    folder, ref16 = mxfp4(torch.bfloat16)
    ids = _prompt()
    truth, theirs = _ref_logits(ref32, ids), _ref_logits(ref16, ids)
    with sluice.load(folder) as m:
        assert m.dtype == torch.bfloat16  # "auto": the checkpoint's non-expert dtype
        ours = m.logits(ids)
    # per position: the largest logit error against the float32 reference. transformers' own bf16 run flips one
    # routing choice here (0.17 at position 3, 0.013-0.029 elsewhere); ours stays at 0.015-0.026. The median
    # keeps the bound tight where a flip makes the maximum loose.
    their_err, our_err = ((x - truth).abs().amax(-1) for x in (theirs, ours))
    assert our_err.max() <= 2 * their_err.max()
    assert our_err.median() <= 2 * their_err.median()


def test_mxfp4_greedy_ids_equal_transformers_generate(mxfp4):
    folder, ref_model = mxfp4()
    ids = _prompt(12, seed=3)
    with torch.no_grad():
        ref = ref_model.generate(
            torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )[0, len(ids):].tolist()
    with sluice.load(folder) as m:
        assert list(m.generate_tokens(ids, max_tokens=10, stop_at_eos=False)) == ref


@pytest.fixture(scope="module", params=["mxfp4", "dequantized"])
def resident_run(request, mxfp4, tmp_path_factory):
    """(folder, logits, tokens, resident bytes, spec) of a resident bf16 run, for each expert layout."""
    if request.param == "mxfp4":
        folder, _ = mxfp4(torch.bfloat16)
    else:
        folder = tmp_path_factory.mktemp("gpt_oss-bf16")
        hf_model("gpt_oss", torch.bfloat16).save_pretrained(folder)
    ids = _prompt()
    with sluice.load(folder) as m:
        return folder, m.logits(ids), list(m.generate_tokens(ids, max_tokens=6, stop_at_eos=False)), \
            m.resident_bytes, m.spec, m.layout.expert_nbytes


@pytest.mark.parametrize("io,odirect", [("mmap", False), ("willneed", False), ("direct", False), ("direct", True)])
def test_streamed_equals_resident(resident_run, io, odirect):
    folder, ref_logits, ref_tokens, resident, spec, expert = resident_run
    ids = _prompt()
    with sluice.load(folder, memory=resident + spec.top_k * expert, io=io, odirect=odirect) as m:
        assert m.store.n_slots == spec.top_k
        logits = m.logits(ids)
        tokens = list(m.generate_tokens(ids, max_tokens=6, stop_at_eos=False))
        st = m.stats()
    assert torch.equal(logits, ref_logits)  # bitwise
    assert tokens == ref_tokens
    assert st["misses"] > 0 and st["bytes_read"] == st["misses"] * m.layout.format(0).stored_nbytes


def test_bad_mxfp4_tensors_name_the_tensor(mxfp4, tmp_path):
    folder, _ = mxfp4()
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    state = load_file(bad / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj_scales"
    state[name] = state[name].to(torch.int16)  # not uint8 E8M0
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        sluice.load(bad)
    assert e.value.tensor == name and "U8" in str(e.value)


def test_make_model_writes_the_shipped_layout(tmp_path):
    """`make-model --arch gpt_oss`: MXFP4 experts that transformers itself loads (dequantizing them) and agrees
    with; `inspect` reports the MXFP4 bytes an expert and a token take."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from sluice.commands.inspect import describe
    from sluice.options import LoadOptions
    from sluice.plan import plan
    from sluice.tools.synth import SynthConfig, make_model, size_of

    sc = SynthConfig(arch="gpt_oss", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     num_experts=4, top_k=2, moe_intermediate_size=64, vocab_size=300, dtype="bfloat16")
    folder = make_model(tmp_path / "m", sc, progress=False)
    info = describe(plan(folder, LoadOptions()))
    one = 3 * 64 * 64 * 17 // 32 + (2 * 64 + 64) * 2  # MXFP4 weights + bf16 biases, no alignment padding needed
    assert (info["dtype"], info["bytes_per_expert"]) == ("mxfp4", one) and size_of(sc).expert_nbytes == one
    assert info["expert_bytes_per_token"] == 2 * 2 * one
    ref_model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=Mxfp4Config(dequantize=True),
                                                     dtype=torch.float32)
    ids = _prompt()
    with sluice.load(folder, dtype="float32") as m:
        out = m.logits(ids)
    assert (out - _ref_logits(ref_model, ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("pos,T", [(0, 20), (13, 1), (13, 5)])
def test_sink_attention_is_the_reference_eager_attention(monkeypatch, pos, T):
    """sinks.sink_attention against transformers' gpt-oss eager attention, with query blocks down to one row and
    a window that ends before the cache does; the window slice layers/attention.py takes changes nothing."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from sluice.models.layers import sinks as sink_module
    from sluice.models.layers.build import causal_mask

    g = torch.Generator().manual_seed(pos)
    nH, nKV, D, window = 4, 2, 16, 6
    q = torch.randn(nH, T, D, generator=g)
    k, v = torch.randn(nKV, pos + T, D, generator=g), torch.randn(nKV, pos + T, D, generator=g)
    sinks = torch.randn(nH, generator=g)
    mask = causal_mask(pos, T, window)
    additive = torch.zeros(T, pos + T) if mask is None else torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    module = SimpleNamespace(num_key_value_groups=nH // nKV, sinks=sinks, training=False)
    ref, _ = eager_attention_forward(module, q[None], k[None], v[None], additive[None, None], scaling=D**-0.5)
    ref = ref[0].transpose(0, 1)  # [nH, T, D]
    monkeypatch.setattr(sink_module, "SINK_SCORE_BYTES", 1)  # one query row per block
    out = sink_module.sink_attention(q, k, v, mask, sinks)
    assert (out - ref).abs().max().item() <= 1e-6
    lo = max(0, pos - window + 1)
    sliced = sink_module.sink_attention(q, k[:, lo:], v[:, lo:], None if mask is None else mask[:, lo:], sinks)
    assert (sliced - ref).abs().max().item() <= 1e-6


def test_router_prefetch_keeps_output_exact(resident_run):
    """The router prerouter (with the router's bias) prefetches into half the experts' slots; the output stays
    bitwise the resident run's."""
    folder, ref_logits, ref_tokens, resident, spec, expert = resident_run
    ids = _prompt()
    slots = sum(spec.moe_layers) * spec.num_experts // 2
    with sluice.load(folder, memory=resident + slots * expert, io="direct", prefetch="router",
                     prefetch_margin=1) as m:
        logits = m.logits(ids)
        tokens = list(m.generate_tokens(ids, max_tokens=6, stop_at_eos=False))
        st = m.stats()
    assert torch.equal(logits, ref_logits) and tokens == ref_tokens
    assert st["prefetch_issued"] > 0


GPT_OSS_20B = {  # the hub's config.json of openai/gpt-oss-20b (its keys as published)
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                             "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                             "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}


@pytest.mark.parametrize("drop", [(), ("rope_scaling", "rope_theta", "head_dim", "layer_types")])
def test_hub_config_gives_transformers_model(drop):
    """gpt-oss-20b's config.json (and one without the keys transformers defaults: yarn rope, head_dim 64, alternating
    layers) -> the Spec and the yarn frequencies transformers' GptOssConfig gives."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from sluice.models import model_args
    from sluice.models.rope import inv_freq

    cfg = {k: v for k, v in GPT_OSS_20B.items() if k not in drop}
    spec = model_args(cfg)[1].spec()
    assert (spec.n_layers, spec.hidden_size, spec.head_dim, spec.n_heads, spec.n_kv_heads) == (24, 2880, 64, 64, 8)
    assert (spec.num_experts, spec.top_k, spec.moe_intermediate_size) == (32, 4, 2880)
    assert spec.sliding_window == [128, None] * 12 and spec.router == "topk_softmax" and spec.attn_sinks
    assert (spec.qkv_bias, spec.o_bias, spec.swiglu_limit, spec.swiglu_alpha) == (True, True, 7.0, 1.702)
    hf = GptOssConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf)
    got, scale = inv_freq(spec.rope)
    assert torch.allclose(got, want, rtol=1e-6) and scale == pytest.approx(want_scale)
