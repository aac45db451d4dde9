"""glm4_moe beyond the shared runner (test_parity.py): the tiny configs' router really depends on the selection bias
and the group limit, the config keys transformers defaults or derives read the same here, bad routing shapes are
ConfigErrors, and a hub-style checkpoint (float32 selection bias, a multi-token-prediction layer after the last
decoder layer) loads to the same logits."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import sluice
import sluice.models.layers.moe as moe
from sluice.models.layers import Step
from sluice.errors import ConfigError
from sluice.models import model_args
from sluice.models.routing import route

from .tiny import TINY, hf_model, write_checkpoint

IDS = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.mark.parametrize("arch", ["glm4_moe", "glm4_moe_qknorm"])
def test_selection_bias_and_group_limit_change_the_tiny_models_routing(tmp_path, monkeypatch, arch):
    """Parity on TINY covers the grouped router only if its parts decide something there: without the group limit
    or without e_score_correction_bias, some token of the parity prompt routes elsewhere."""
    folder = write_checkpoint(hf_model(arch, torch.float32), tmp_path / "m", "per_expert")
    seen = []

    def recording(spec, lw, x, bf16=True):
        seen.append((spec, lw, x))
        return route(spec, lw, x, bf16)

    monkeypatch.setattr(moe, "route", recording)
    with sluice.load(folder) as m:
        m.logits(IDS)
    assert seen
    changed = {"groups": False, "bias": False}
    for spec, lw, x in seen:
        ids = route(spec, lw, x)[1].sort(dim=1).values
        free = dataclasses.replace(spec, n_group=1, topk_group=1)
        changed["groups"] |= not torch.equal(route(free, lw, x)[1].sort(dim=1).values, ids)
        unbiased = dataclasses.replace(lw, router_bias=None)
        changed["bias"] |= not torch.equal(route(spec, unbiased, x)[1].sort(dim=1).values, ids)
    assert changed == {"groups": True, "bias": True}


def test_config_defaults_follow_transformers():
    """partial_rotary_factor 0.5 when config.json says nothing (rope_parameters' wins over the top-level key), the
    expert count spelled n_routed_experts, and head_dim hidden // heads when absent -- as Glm4MoeConfig has them."""
    from transformers import Glm4MoeConfig

    base = {k: v for k, v in TINY["glm4_moe"].items() if k != "partial_rotary_factor"}
    spec = model_args(base)[1].spec()
    assert spec.rope.partial_rotary_factor == 0.5 == Glm4MoeConfig(**base).rope_parameters["partial_rotary_factor"]
    nested = {**base, "partial_rotary_factor": 0.75,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}}
    assert model_args(nested)[1].spec().rope.partial_rotary_factor == 0.25
    assert Glm4MoeConfig(**nested).rope_parameters["partial_rotary_factor"] == 0.25
    assert spec.num_experts == 8 and spec.moe_layers == [False, True, True]
    assert spec.shared_expert_intermediate_size == 24 and spec.router == "sigmoid_grouped"
    odd = {**base, "hidden_size": 66, "head_dim": None}  # transformers: head_dim = 66 // 4 = 16
    assert model_args(odd)[1].spec().head_dim == 16


BAD = [
    (dict(n_group=3), "n_group", "a divisor of n_routed_experts (8)"),
    (dict(topk_group=5), "topk_group", "n_group (4)"),
    (dict(n_group=8, topk_group=2), "n_group", "at least 2 experts per group"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok", "at most 4"),  # 2 selectable groups of 2
    (dict(first_k_dense_replace=3), "first_k_dense_replace", "< num_hidden_layers (3)"),
    (dict(intermediate_size=None), "intermediate_size", "dense"),
    (dict(routed_scaling_factor=0), "routed_scaling_factor", "> 0"),
    (dict(n_shared_experts=-1), "n_shared_experts", "from 0"),
]


@pytest.mark.parametrize("changes,field,needle", BAD, ids=[json.dumps(c) for c, _, _ in BAD])
def test_bad_routing_config_names_the_field(changes, field, needle):
    cfg = {k: v for k, v in {**TINY["glm4_moe"], **changes}.items() if v is not None}
    with pytest.raises(ConfigError) as e:
        model_args(cfg, "/m/config.json")[1].spec()
    assert (e.value.file, e.value.field) == ("/m/config.json", field), str(e.value)
    assert needle in str(e.value), str(e.value)


def test_hub_layout_with_float32_bias_and_a_nextn_layer_loads(tmp_path):
    """The hub's GLM files are bf16 but store e_score_correction_bias in float32, and append
    num_nextn_predict_layers multi-token-prediction layers (model.layers.{num_hidden_layers}.*, experts included):
    sluice reads the bias as stored and ignores the extra layer, like transformers."""
    folder = write_checkpoint(hf_model("glm4_moe", torch.bfloat16), tmp_path / "saved", "per_expert")
    with sluice.load(folder) as m:
        want = m.logits(IDS)
    hub = tmp_path / "hub"
    hub.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (hub / f.name).write_bytes(f.read_bytes())
    (shard,) = folder.glob("*.safetensors")
    tensors = load_file(shard)
    n = TINY["glm4_moe"]["num_hidden_layers"]
    for name in [k for k in tensors if k.startswith("model.layers.1.")]:  # a copy of a MoE layer as the MTP layer
        tensors[name.replace("model.layers.1.", f"model.layers.{n}.")] = tensors[name].clone()
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(64, 128, dtype=torch.bfloat16)
    for name in [k for k in tensors if k.endswith("e_score_correction_bias")]:
        assert tensors[name].dtype == torch.bfloat16 and tensors[name].abs().max() > 0
        tensors[name] = tensors[name].float()
    save_file(tensors, hub / shard.name, metadata={"format": "pt"})
    cfg = json.loads((hub / "config.json").read_text())
    (hub / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    with sluice.load(hub) as m:
        assert m.dtype == torch.bfloat16 and m.layout.layers == [1, 2]
        assert torch.equal(m.logits(IDS), want)


@pytest.mark.parametrize("arch", ["glm4_moe", "glm4_moe_qknorm"])
def test_bf16_moe_block_rounds_like_transformers_eager_experts(tmp_path, arch):
    """One decode token through a bf16 MoE layer (router, routed experts, shared experts) is bitwise transformers'
    eager Glm4MoeMoE: each expert's output times its float32 weight, cast to bf16, summed in ascending expert id,
    then the shared experts added. (transformers' default grouped_mm instead sums the k weighted outputs in float32
    and rounds once: up to 1 bf16 ulp apart.) One token: the same F.linear calls on the same shapes both sides."""
    model = hf_model(arch, torch.bfloat16)
    model.set_experts_implementation("eager")
    folder = write_checkpoint(model, tmp_path / "m", "per_expert")
    g = torch.Generator().manual_seed(0)
    with sluice.load(folder) as m, torch.no_grad():
        for L in (1, 2):
            for _ in range(4):
                x = torch.randn(1, 64, generator=g).to(torch.bfloat16)
                assert torch.equal(m.model.layers[L].ffn(x, Step(0, 1)), model.model.layers[L].mlp(x[None])[0])
