"""The architecture interface (sluice/models/__init__.py): every registered architecture provides it, and a new one
is one module: a renamed copy of qwen3_moe, registered at runtime from a temp folder, gets synthetic checkpoints,
loads and inflates with no other file touched."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import sluice
from sluice import models
from sluice.checkpoint.multimodal import text_config, text_tensors
from sluice.errors import ConfigError
from sluice.models.arch import TensorName
from sluice.tools.inflate import inflate
from sluice.tools.synth import SynthConfig, config_json, make_model, size_of, tensors
from sluice.plan import open_index

IDS = [5, 17, 3, 250, 42, 7, 99, 1]


def tiny(arch: str, **kw) -> SynthConfig:
    base = dict(arch=arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4,
                top_k=2, moe_intermediate_size=32, vocab_size=300, dtype="float32")
    return SynthConfig(**{**base, **kw})


# -- every registered architecture -----------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", models.supported())
def test_each_architecture_provides_the_interface(model_type):
    arch = models.get_arch(model_type)
    models.check_arch(arch)
    assert arch.MODEL_TYPE == model_type == arch.__name__.rsplit(".", 1)[1]  # one file per model_type, named so
    sc = tiny(model_type)
    cfg = config_json(sc)
    assert cfg["model_type"] == model_type
    cfg = text_config(cfg)  # a multimodal wrapper's text model (qwen3_5_moe), as the checkpoint index reads it
    assert cfg[arch.INTERMEDIATE_KEY] == sc.moe_intermediate_size  # the key inflation scales is the experts' size
    spec = arch.ModelArgs.from_dict(cfg).spec()
    assert spec.moe_intermediate_size == sc.moe_intermediate_size
    L = spec.moe_layers.index(True)  # the first MoE layer (glm4_moe's layer 0 is dense)
    moe = f"model.layers.{L}.{arch.MOE_PREFIXES[0]}"
    layer = arch.layer_tensors(spec, L, moe)
    assert all(isinstance(t, TensorName) and t.name.startswith(f"model.layers.{L}.") for t in layer)
    assert len({t.role for t in layer}) == len({t.name for t in layer}) == len(layer)
    assert f"{moe}.{arch.ROUTER}.weight" in {t.name for t in layer}  # the router, where store/layout.py looks for it
    # the synthetic checkpoint holds exactly the layer's resident tensors plus the experts' projections
    written = {name for name in text_tensors(dict(tensors(sc))) if name.startswith(f"model.layers.{L}.")}
    if spec.ple is not None and L in spec.ple.layers:  # its n-gram table (read by rows) and the hash's buffers
        hashes = {n.format(layer=L) for n in spec.ple.hashes.values()}
        table = spec.ple.table.format(layer=L) + "."
        assert any(n.startswith(table) for n in written) and hashes <= written
        written = {n for n in written if not n.startswith(table) and n not in hashes}
    experts = {f"{moe}.experts.{e}.{p}.weight" for e in range(sc.num_experts) for p in arch.EXPERT_PROJ}
    if arch.synth_experts is not None:  # the architecture writes its experts itself (gpt_oss: MXFP4 + biases)
        draw = lambda shape, kind: torch.zeros(shape)  # noqa: E731
        experts = {n for n, _ in arch.synth_experts(sc, draw, torch.Generator(), f"{moe}.experts")}
        assert experts and all(n.startswith(f"{moe}.experts.") for n in experts)
    assert written == {t.name for t in layer} | experts


def test_gguf_facts_are_unambiguous():
    """One GGUFArch per llama.cpp name; modules sharing a name share the one object (the same model in another
    checkpoint layout: qwen3_5_moe_text), and a file of that name opens as the first of them."""
    with_gguf = [a for a in models.archs().values() if a.GGUF is not None]
    first = {}
    for a in with_gguf:
        first.setdefault(a.GGUF.name, a)
        assert a.GGUF is first[a.GGUF.name].GGUF, a.MODEL_TYPE
        assert models.by_gguf_name(a.GGUF.name) is first[a.GGUF.name]
        assert models.gguf_archs()[a.GGUF.name].model_type == first[a.GGUF.name].MODEL_TYPE
        assert len(set(a.GGUF.tensors.values())) == len(a.GGUF.tensors)  # the mapping inverts (gguf_name)
    assert models.by_gguf_name("qwen35moe").MODEL_TYPE == "qwen3_5_moe"
    assert models.by_gguf_name("gemma3") is None


def test_check_arch_names_what_is_missing_or_wrong():
    bare = ModuleType("plugin_arch")
    bare.MODEL_TYPE = "plugin"
    with pytest.raises(ConfigError, match=r"plugin_arch lacks ModelArgs, MOE_PREFIXES, EXPERT_PROJ, INTERMEDIATE_KEY"):
        models.register(bare)
    wrong = ModuleType("wrong_arch")
    for name in models.INTERFACE:
        setattr(wrong, name, getattr(models.get_arch("qwen3_moe"), name))
    wrong.MODEL_TYPE, wrong.EXPERT_PROJ, wrong.GGUF = "wrong", ("w1", "w2"), "qwen3moe"
    with pytest.raises(ConfigError, match=r"wrong_arch: EXPERT_PROJ, GGUF not of the documented type"):
        models.register(wrong)
    with pytest.raises(ConfigError, match=r"'qwen3_moe' is already registered"):
        models.register(models.get_arch("qwen3_moe"))
    assert "plugin" not in models.supported() and "wrong" not in models.supported()


# -- a new architecture is one file ----------------------------------------------------------------------------------
def _renamed_copy(folder: Path) -> ModuleType:
    """qwen3_moe.py copied outside the package as model_type `toy_moe`, with its own MoE block and expert names and
    no GGUF architecture."""
    src = (Path(models.__file__).parent / "qwen3_moe.py").read_text()
    for old, new in (
        (r'^MODEL_TYPE = "qwen3_moe"$', 'MODEL_TYPE = "toy_moe"'),
        (r"^MOE_PREFIXES = .*$", 'MOE_PREFIXES = ("moe",)'),
        (r"^EXPERT_PROJ = .*$", 'EXPERT_PROJ = ("w_gate", "w_up", "w_down")'),
        (r"^from \.(?!\.)", "from sluice.models."),  # its imports, now from outside the package
    ):
        src, n = re.subn(old, new, src, flags=re.M)
        assert n >= 1, old
    assert not re.search(r"^from \.", src, flags=re.M)
    src += "\nGGUF = None  # llama.cpp has no such architecture\n"
    path = folder / "toy_moe_arch.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("toy_moe_arch", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["toy_moe_arch"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def toy(tmp_path):
    module = _renamed_copy(tmp_path)
    models.register(module)
    try:
        yield module
    finally:
        models.unregister("toy_moe")
        del sys.modules["toy_moe_arch"]


def test_a_registered_module_synthesizes_loads_and_inflates(toy, tmp_path):
    assert "toy_moe" in models.supported() and models.get_arch("toy_moe") is toy
    assert models.by_gguf_name("qwen3moe").MODEL_TYPE == "qwen3_moe"  # GGUF None: no GGUF file maps to it
    out = make_model(tmp_path / "toy", tiny("toy_moe"), progress=False)
    index = open_index(out)
    assert index.config["model_type"] == "toy_moe"
    assert "model.layers.1.moe.experts.3.w_down.weight" in index.names()
    assert not any(".mlp." in n or "gate_proj" in n for n in index.names())
    # the same numbers under other names: the qwen3_moe checkpoint of the same SynthConfig is the same model
    ref = make_model(tmp_path / "ref", tiny("qwen3_moe"), progress=False)
    with sluice.load(ref, memory="all") as m:
        want = m.logits(IDS)
    with sluice.load(out, memory="all") as m:
        got = m.logits(IDS)
        memory = m.resident_bytes + m.spec.top_k * m.layout.expert_nbytes
    assert torch.equal(got, want)
    with sluice.load(out, memory=memory, io="direct") as m:  # streamed through the store's per-expert ranges
        assert torch.equal(m.logits(IDS), want)
    big = inflate(out, tmp_path / "big", 3, progress=False)
    assert open_index(big).config["moe_intermediate_size"] == 96
    with sluice.load(big, memory="all") as m:
        torch.testing.assert_close(m.logits(IDS), want, rtol=1e-5, atol=1e-5)


def test_dense_layers_come_from_the_architecture(toy, tmp_path, monkeypatch):
    """Which layers are dense is the architecture's rule (ModelArgs.moe_layers): synth writes a dense MLP and no
    experts there, sizes the checkpoint by it, and the model loads and streams."""
    plain = toy.synth_config
    monkeypatch.setattr(toy, "synth_config", lambda sc: {**plain(sc), "mlp_only_layers": [0]})
    sc = tiny("toy_moe", num_layers=3)
    out = make_model(tmp_path / "dense", sc, progress=False)
    index = open_index(out)
    names = set(index.names())
    assert {f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")} <= names
    assert not any(n.startswith("model.layers.0.moe.") for n in names)
    assert "model.layers.2.moe.experts.3.w_up.weight" in names
    written = dataclasses.replace(sc, vocab_size=index.config["vocab_size"])
    assert size_of(written).total_bytes == sum(index[n].nbytes for n in names)
    with sluice.load(out, memory="all") as m:
        want = m.logits(IDS)
        assert m.spec.moe_layers == [False, True, True]
        memory = m.resident_bytes + m.spec.top_k * m.layout.expert_nbytes
    with sluice.load(out, memory=memory, io="direct") as m:
        assert torch.equal(m.logits(IDS), want)
