"""The routers of models/routing.py against transformers' own router modules on random inputs."""

from __future__ import annotations

import pytest
import torch

from sluice.models.routing import route
from sluice.models.spec import LayerWeights, Spec


def _spec(E: int, K: int, **kw) -> Spec:
    return Spec(vocab_size=8, hidden_size=16, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=16, rms_norm_eps=1e-6,
                rope=None, num_experts=E, top_k=K, moe_intermediate_size=8, moe_layers=[True],
                sliding_window=[None], **kw)


def _layer(router: torch.Tensor, bias: torch.Tensor | None) -> LayerWeights:
    z = torch.zeros(1)
    return LayerWeights(input_norm=z, post_norm=z, q=z, k=z, v=z, o=z, router=router, router_bias=bias)


@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3"])
@pytest.mark.parametrize("n_group,topk_group,norm", [(4, 2, True), (8, 3, False), (1, 1, True)])
def test_sigmoid_grouped_matches_transformers(arch, n_group, topk_group, norm):
    if arch == "glm4_moe":
        from transformers import Glm4MoeConfig as Config
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter as Router
    else:
        from transformers import DeepseekV3Config as Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as Router
    E, K, H, T = 32, 6, 16, 40
    cfg = Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, n_group=n_group, topk_group=topk_group,
                 norm_topk_prob=norm, routed_scaling_factor=2.5)
    g = torch.Generator().manual_seed(n_group * 10 + topk_group)
    ref = Router(cfg)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(E, H, generator=g).to(torch.bfloat16))  # as a bf16 checkpoint stores it
        # a bias large enough to change which experts and groups win
        ref.e_score_correction_bias.copy_(torch.randn(E, generator=g))
    x = torch.randn(T, H, generator=g, dtype=torch.float32).to(torch.bfloat16)
    _, ref_w, ref_ids = ref(x)
    spec = _spec(E, K, router="sigmoid_grouped", n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                 routed_scaling_factor=2.5)
    w, ids = route(spec, _layer(ref.weight.detach().to(torch.bfloat16), ref.e_score_correction_bias.clone()), x)
    # topk(sorted=False) orders are implementation-defined: compare (id -> weight) per token
    o1, o2 = ids.sort(dim=1), ref_ids.sort(dim=1)
    assert torch.equal(o1.values, o2.values)
    assert torch.allclose(w.gather(1, o1.indices), ref_w.gather(1, o2.indices), rtol=1e-6, atol=0)
    assert w.dtype == torch.float32
    if topk_group < n_group:  # the group limit really excluded experts some token would otherwise pick
        free = _spec(E, K, router="sigmoid_grouped", n_group=1, topk_group=1, norm_topk_prob=norm)
        _, ids_free = route(free, _layer(ref.weight.detach().to(torch.bfloat16), ref.e_score_correction_bias), x)
        assert not torch.equal(ids_free.sort(dim=1).values, o1.values)
