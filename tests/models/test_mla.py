"""deepseek_v3 beyond the shared parity runner: the latent KV cache's size (what the budget plans and inspect shows),
the interleaved rope against transformers' own function, the softmax scale's yarn correction, config relations of
the grouped router, and `make-model --arch deepseek_v3` loading in transformers with sluice's logits."""

from __future__ import annotations

import json

import pytest
import torch

import sluice
from sluice.commands.inspect import describe
from sluice.errors import ConfigError
from sluice.models import model_args
from sluice.models.layers import mla
from sluice.models.layers.mla import absorbs, latent_attention, rope_interleaved
from sluice.models.spec import KVCache, LayerWeights, MLAWeights
from sluice.options import LoadOptions
from sluice.plan import plan
from sluice.tools.inflate import inflate
from sluice.tools.synth import SynthConfig, config_json, make_model, size_of

from .tiny import TINY, hf_model, write_checkpoint

IDS = [5, 17, 3, 250, 42, 7, 99, 1, 64, 12]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_checkpoint(hf_model("deepseek_v3", torch.bfloat16), tmp_path_factory.mktemp("dsv3"), "per_expert")


def test_kv_cache_holds_the_latent_not_the_heads(folder):
    cfg = TINY["deepseek_v3"]
    per_position = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]  # 16 + 8, for every head at once
    expanded = cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"])
    p = plan(folder, LoadOptions(max_context=100))
    want = cfg["num_hidden_layers"] * 100 * per_position * 2  # bf16
    assert p.kv_bytes == want and want < cfg["num_hidden_layers"] * 100 * expanded * 2 / 4
    info = describe(p)
    assert (info["kv_cache_bytes"], info["kv_bytes_per_position"], info["attention"]) == (
        want, cfg["num_hidden_layers"] * per_position * 2, "mla")
    with sluice.load(folder, max_context=100) as m:
        layers = m.cache.layers
        assert len(layers) == cfg["num_hidden_layers"]
        assert all(c.k is None and c.recurrent is None and c.latent.shape == (100, per_position) for c in layers)
        assert m.cache.nbytes == sum(c.latent.nbytes for c in layers) == want == m.stats()["kv_cache_bytes"]
        m.logits(IDS)
        # the cached latent is the normed compressed kv of each position (a written cache, not a spare buffer)
        assert min(c.latent[: len(IDS)].abs().sum(-1).min() for c in layers) > 0


def test_interleaved_rope_is_transformers_own():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 6, 8, generator=g), torch.randn(1, 1, 6, 8, generator=g)
    ang = torch.randn(6, 4, generator=g)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()  # [T, R]
    rq, rk = apply_rotary_pos_emb_interleave(q, k, cos[None], sin[None])
    assert torch.equal(rope_interleaved(q[0], cos, sin), rq[0]) and torch.equal(rope_interleaved(k[0], cos, sin), rk[0])


def test_softmax_scale_is_transformers_with_the_yarn_correction():
    model = hf_model("deepseek_v3")
    _, args = model_args(dict(TINY["deepseek_v3"]))
    scale = args.spec().mla.softmax_scale
    assert scale == model.model.layers[0].self_attn.scaling
    assert scale > (12 + 8) ** -0.5 * 1.05  # mscale_all_dim 0.7, factor 4: (0.07 ln 4 + 1)^2 = 1.20
    _, plain = model_args({**TINY["deepseek_v3"], "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.spec().mla.softmax_scale == (12 + 8) ** -0.5


@pytest.mark.parametrize("changes,field", [
    (dict(n_group=3), "n_group"),  # does not divide 8 experts
    (dict(topk_group=5), "topk_group"),  # more than n_group
    (dict(n_group=8, topk_group=4), "n_group"),  # groups of one expert cannot be scored by their best two
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),  # more than the 2 groups of 2 selectable hold
    (dict(first_k_dense_replace=3), "first_k_dense_replace"),  # no MoE layer left
    (dict(intermediate_size=0), "intermediate_size"),  # the dense first layer has no size
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
    # weights quantized another way would be read without their scales (FP8's are read: tests/quant/test_fp8_models.py)
    (dict(quantization_config={"quant_method": "awq", "bits": 4, "group_size": 128}), "quantization_config"),
])
def test_router_and_layer_relations_are_config_errors(changes, field):
    with pytest.raises(ConfigError) as e:
        model_args({**TINY["deepseek_v3"], **changes}, "/m/config.json")[1].spec()
    assert e.value.field == field and "/m/config.json" in str(e.value)


def test_an_fp8_quantization_config_is_read():
    """The hub's FP8 quantization_config (DeepSeek-V3 / R1, Kimi K2) is no config problem: the checkpoint index pairs
    each FP8 weight with its weight_scale_inv (checkpoint/fp8_index.py)."""
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert model_args({**TINY["deepseek_v3"], "quantization_config": q}, "/m/config.json")[1].spec().mla is not None


def test_make_model_writes_a_checkpoint_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    sc = SynthConfig(arch="deepseek_v3", hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=4, head_dim=16,
                     num_experts=16, top_k=4, moe_intermediate_size=32, vocab_size=512, dtype="float32")
    cfg = config_json(sc)
    assert (cfg["n_group"], cfg["topk_group"], cfg["first_k_dense_replace"], cfg["n_shared_experts"]) == (8, 4, 1, 1)
    out = make_model(tmp_path / "m", sc, progress=False)
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()  # no missing or unexpected keys
    with torch.no_grad():
        want = ref(torch.tensor([IDS])).logits[0]
    with sluice.load(out) as m:
        assert (m.logits(IDS) - want).abs().max().item() <= 1e-4
        info = describe(m.load_plan)
    assert info["expert_bytes_per_token"] == 2 * 4 * 3 * 64 * 32 * 4  # 2 MoE layers x top-4 x gate/up/down
    assert info["kv_bytes_per_position"] == 3 * (cfg["kv_lora_rank"] + 16 // 2) * 4  # 3 layers, float32
    assert size_of(sc).total_bytes == sum(f.stat().st_size for f in out.glob("*.safetensors")) - sum(
        8 + int.from_bytes(f.read_bytes()[:8], "little") for f in out.glob("*.safetensors"))
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v3-q_proj"])
def test_both_forms_match_transformers(tmp_path, arch):
    """A 48-token prompt in one chunk takes the expanded form (the tiny shapes absorb up to 35 tokens), chunks of 7
    and the decode steps the absorbed one; both give transformers' fp32 logits and greedy tokens."""
    model = hf_model(arch)
    folder = write_checkpoint(model, tmp_path / "m", "per_expert")
    ids = torch.randint(0, 300, (48,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    with sluice.load(folder) as m:
        spec = m.spec
        assert not absorbs(spec.mla, spec.n_heads, len(ids), len(ids), 4) and absorbs(spec.mla, spec.n_heads, 7, 48, 4)
        assert (m.logits(ids) - want).abs().max().item() <= 1e-4
    with sluice.load(folder, prefill_chunk=7) as m:
        assert (m.logits(ids) - want).abs().max().item() <= 1e-4
    with sluice.load(folder) as m, pytest.MonkeyPatch.context() as mp:
        mp.setattr(mla, "ATTN_ROOM", 1)  # no room: absorbed, one query at a time, even for the 48-token chunk
        assert absorbs(spec.mla, spec.n_heads, len(ids), len(ids), 4)
        assert (m.logits(ids) - want).abs().max().item() <= 1e-4


def test_absorbed_and_expanded_forms_agree():
    _, args = model_args(dict(TINY["deepseek_v3"]))
    spec = args.spec()
    m, H, nH, T, pos = spec.mla, spec.hidden_size, spec.n_heads, 5, 9
    g = torch.Generator().manual_seed(3)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.3

    w = MLAWeights(kv_a=r(m.cache_dim, H), kv_a_norm=1 + r(m.kv_lora_rank),
                   kv_b=r(nH * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), q_a=r(m.q_lora_rank, H),
                   q_a_norm=1 + r(m.q_lora_rank), q_b=r(nH * m.qk_head_dim, m.q_lora_rank))
    lw = LayerWeights(input_norm=r(H), post_norm=r(H), o=r(H, nH * m.v_head_dim), mla=w)
    x, past = r(T, H), r(pos, m.cache_dim)
    ang = r(T, m.qk_rope_head_dim // 2)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    mask = torch.arange(pos + T)[None] <= torch.arange(pos, pos + T)[:, None]
    outs = []
    for absorb in (True, False):
        cache = torch.zeros(pos + T, m.cache_dim)
        cache[:pos] = past
        outs.append(latent_attention(m, nH, lw, x, cache, pos, mask, cos, sin, absorb=absorb))
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-5 * outs[1].abs().max().item()
    assert not torch.equal(outs[0], outs[1])  # two different computations, not one path twice


def test_inflated_checkpoint_pads_the_shared_experts_and_keeps_the_tokens(folder, tmp_path):
    """The shared experts are n_shared_experts x moe_intermediate_size wide: inflation pads them with the experts."""
    big = inflate(folder, tmp_path / "big", 3, progress=False)
    with sluice.load(folder) as m:
        want = list(m.generate_tokens(IDS, max_tokens=6, stop_at_eos=False))
    with sluice.load(big) as m:
        shared = m.model.w.layers[1].shared.gate  # [n_shared * 3I, H], the rows past n_shared * I all zero
        assert shared.shape[0] == 3 * TINY["deepseek_v3"]["moe_intermediate_size"]
        assert not shared[TINY["deepseek_v3"]["moe_intermediate_size"]:].any()
        assert list(m.generate_tokens(IDS, max_tokens=6, stop_at_eos=False)) == want


DEEPSEEK_V3 = {  # the hub's config.json of DeepSeek-V3 / R1, without its FP8 quantization_config
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "ep_size": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
    "bos_token_id": 0, "eos_token_id": 1, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "bfloat16",
}


def test_the_hub_config_gives_a_576_value_cache_and_transformers_scale():
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    spec = model_args(dict(DEEPSEEK_V3))[1].spec()
    assert spec.moe_layers == [False] * 3 + [True] * 58 and (spec.n_group, spec.topk_group) == (8, 4)
    assert spec.mla.cache_dim == 576 and spec.rope.head_dim == 64
    config = AutoConfig.for_model(**{k: v for k, v in DEEPSEEK_V3.items()})
    assert spec.mla.softmax_scale == yarn_apply_mscale(config.rope_parameters, 192 ** -0.5)
    # 4096 positions in bf16: 274.5 MiB of latents where expanded keys and values would take 19.1 GiB
    assert KVCache.bytes_for(spec, 4096, 2) == 61 * 4096 * 576 * 2


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v3-q_proj"])
def test_bf16_error_within_twice_transformers_own(tmp_path, arch):
    """Against fp32 transformers, sluice's bf16 logits are off by at most twice what transformers' bf16 run is
    (measured: 0.81x and 0.91x)."""
    ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    exact, model = hf_model(arch), hf_model(arch, torch.bfloat16)
    with torch.no_grad():
        want, theirs = (mdl(torch.tensor([ids])).logits[0].float() for mdl in (exact, model))
    with sluice.load(write_checkpoint(model, tmp_path / "m", "per_expert")) as m:
        ours = m.logits(ids)
    assert (ours - want).abs().max() <= 2 * (theirs - want).abs().max()
