"""Synthetic checkpoints: transformers loads them cleanly, sizes land on target, bytes are reproducible, routing
spreads, and `sluice make-model` writes them atomically."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from sluice import cli
from sluice.checkpoint.multimodal import text_config, text_tensors
from sluice.errors import ConfigError
from sluice.models import get_arch, supported
from sluice.tools.synth import OutputExistsError, SynthConfig, config_for_size, make_model, size_of, tensors

MiB, GiB = 2**20, 2**30
ARCH_NAMES = list(supported())


def tiny(arch: str, **kw) -> SynthConfig:
    """hidden 64, 2 layers, 4 experts: loads in transformers in well under a second."""
    base = dict(arch=arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4,
                top_k=2, moe_intermediate_size=32, vocab_size=300, dtype="float32")
    base.update(kw)
    return SynthConfig(**base)


def hf_load(path: Path):
    """The checkpoint as its config's `architectures` class loads it (a multimodal wrapper: its
    *ForConditionalGeneration), and the loading info."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, Mxfp4Config

    cfg = json.loads((path / "config.json").read_text())
    quantized = "quantization_config" in cfg  # gpt_oss: MXFP4 experts
    extra = {"quantization_config": Mxfp4Config(dequantize=True)} if quantized else {}
    auto = AutoModelForImageTextToText if "text_config" in cfg else AutoModelForCausalLM
    model, info = auto.from_pretrained(path, output_loading_info=True, dtype=torch.float32, **extra)
    return model.eval(), info


def text_model(model):
    """The decoder of a transformers model (inside a multimodal wrapper: its language model)."""
    return getattr(model.model, "language_model", model.model)


@pytest.mark.parametrize(
    "arch,layout", [(a, "per_expert") for a in ARCH_NAMES] + [("qwen3_moe", "fused"), ("mixtral", "fused")]
)
def test_transformers_loads_without_missing_or_unexpected_keys(tmp_path, arch, layout):
    sc = tiny(arch, layout=layout, tie_word_embeddings=arch == "qwen2_moe")
    out = make_model(tmp_path / "m", sc, progress=False)
    model, info = hf_load(out)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    assert type(model).__name__ == get_arch(arch).SYNTH.hf_class
    cfg = text_config(json.loads((out / "config.json").read_text()))
    assert cfg["vocab_size"] >= 300 and cfg["eos_token_id"] == 2
    # The generated numbers reach the right parameters: expert 1 of layer 1, gate rows then up rows.
    gen = text_tensors(dict(tensors(sc)))  # the text model's under model.* (a wrapper's model.language_model.*)
    experts = text_model(model).layers[1].mlp.experts
    if get_arch(arch).synth_experts is not None:  # gpt_oss: MXFP4, dequantized by transformers to [H, 2I]
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        x = "model.layers.1.mlp.experts.gate_up_proj"
        want_gu = convert_moe_packed_tensors(gen[f"{x}_blocks"][1:2], gen[f"{x}_scales"][1:2], dtype=torch.float32)[0]
    elif layout == "fused":
        want_gu = gen["model.layers.1.mlp.experts.gate_up_proj"][1]
    else:
        g, u, _ = get_arch(arch).EXPERT_PROJ
        p = f"model.layers.1.{get_arch(arch).MOE_PREFIXES[0]}.experts.1"
        want_gu = torch.cat([gen[f"{p}.{g}.weight"], gen[f"{p}.{u}.weight"]])
    assert torch.equal(experts.gate_up_proj[1], want_gu)
    assert torch.equal(text_model(model).embed_tokens.weight, gen["model.embed_tokens.weight"])


def test_layouts_hold_the_same_model():
    a = dict(tensors(tiny("qwen3_moe")))
    b = dict(tensors(tiny("qwen3_moe", layout="fused")))
    p = "model.layers.0.mlp.experts"
    assert torch.equal(b[f"{p}.down_proj"][3], a[f"{p}.3.down_proj.weight"])
    assert torch.equal(b[f"{p}.gate_up_proj"][2], torch.cat([a[f"{p}.2.gate_proj.weight"], a[f"{p}.2.up_proj.weight"]]))
    assert torch.equal(a["lm_head.weight"], b["lm_head.weight"])


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_sluice_matches_transformers_on_a_synthetic_model(tmp_path, arch):
    import sluice

    out = make_model(tmp_path / "m", tiny(arch), progress=False)
    model, _ = hf_load(out)
    ids = [5, 17, 3, 250, 42, 7]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].float()
    got = sluice.load(out).logits(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_tokenizer_and_chat_template_load_in_transformers(tmp_path):
    from transformers import AutoTokenizer

    out = make_model(tmp_path / "m", tiny("qwen3_moe"), progress=False)
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_id == json.loads((out / "generation_config.json").read_text())["eos_token_id"]


def test_a_familys_special_tokens_and_router_keys_are_written_as_the_hub_has_them(tmp_path):
    """GLM's added tokens ([gMASK], <|user|>, ... which llama.cpp's glm4moe converter looks up by name) after the
    trained tokenizer's three, and DeepSeek's scoring_func / topk_method (which transformers does not save; without
    scoring_func llama.cpp's converter writes no gating function and the file routes by softmax there)."""
    from transformers import AutoTokenizer

    glm = make_model(tmp_path / "glm", tiny("glm4_moe"), progress=False)
    added = AutoTokenizer.from_pretrained(glm).get_added_vocab()
    assert [added[t] for t in ("<|endoftext|>", "<|im_end|>", "[MASK]", "[gMASK]", "<|observation|>")] == \
        [0, 2, 3, 4, 11]
    qwen = make_model(tmp_path / "qwen", tiny("qwen3_moe"), progress=False)
    assert set(AutoTokenizer.from_pretrained(qwen).get_added_vocab()) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    ds = make_model(tmp_path / "ds", tiny("deepseek_v3", num_kv_heads=4), progress=False)
    cfg = json.loads((ds / "config.json").read_text())
    assert (cfg["scoring_func"], cfg["topk_method"]) == ("sigmoid", "noaux_tc")


@pytest.mark.parametrize("arch", ARCH_NAMES)
@pytest.mark.parametrize("target", [64 * MiB, 512 * MiB, 2 * GiB, 6 * GiB])
def test_config_for_size_hits_target_with_experts_dominating(arch, target):
    sc = config_for_size(arch, target)
    r = size_of(sc)
    assert abs(r.total_bytes / target - 1) < 0.05, (sc, r)
    # qwen4_exp keeps more beside its experts: two hyper-connection mixers per layer (rank 5/32 of 4 streams) and a
    # PLE block's key / value projections: 84% experts at 2 GiB (hidden 1024, 16 layers)
    assert r.expert_share > (0.8 if arch == "qwen4_exp" else 0.85), (sc, r)
    info = get_arch(arch).SYNTH  # the family's expert count and top-k (64 top-8 Qwen, 8 top-2 Mixtral, ...)
    assert (sc.num_experts, sc.top_k) == (info.num_experts, info.top_k)
    assert 4 <= sc.num_layers <= 48


def test_config_for_size_rule_scales_and_honours_overrides():
    assert config_for_size("qwen3_moe", 2 * GiB).num_layers == 16
    small, big = config_for_size("qwen3_moe", 512 * MiB), config_for_size("qwen3_moe", 6 * GiB)
    assert small.num_layers < big.num_layers and small.moe_intermediate_size < big.moe_intermediate_size
    sc = config_for_size("olmoe", GiB, num_layers=40, dtype="float32", layout="fused")
    assert (sc.num_layers, sc.dtype, sc.layout) == (40, "float32", "fused")
    assert abs(size_of(sc).total_bytes / GiB - 1) < 0.05
    sc = config_for_size("mixtral", GiB, moe_intermediate_size=1024)  # the layer count is solved instead
    assert sc.moe_intermediate_size == 1024 and abs(size_of(sc).total_bytes / GiB - 1) < 0.05
    with pytest.raises(ConfigError, match="unknown"):
        config_for_size("qwen3_moe", GiB, num_layer=3)
    with pytest.raises(ConfigError, match="arch"):
        config_for_size("llama", GiB)


def test_cli_writes_a_64mib_sharded_model(tmp_path, capsys):
    out = tmp_path / "m64"
    rc = cli.main(["make-model", str(out), "--arch", "qwen3_moe", "--size", "64MiB", "--shard-size", "16MiB",
                   "--no-progress"])
    assert rc == 0
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) >= 4 and (out / "model.safetensors.index.json").is_file()
    total = sum(p.stat().st_size for p in shards)
    assert abs(total / (64 * MiB) - 1) < 0.05
    assert all(p.stat().st_size <= 16 * MiB + 64 * 1024 for p in shards)  # + header
    printed = capsys.readouterr().out
    assert "experts 9" in printed and "one expert" in printed and "model.safetensors.index.json" in printed
    assert not list(tmp_path.glob("*.partial"))


def test_cli_user_errors_are_clean(tmp_path, capsys):
    out = tmp_path / "m"
    assert cli.main(["make-model", str(out), "--size", "1MiB"]) == 2
    assert "--arch is required" in capsys.readouterr().err
    assert cli.main(["make-model", str(out), "--arch", "mixtral", "--size", "lots"]) == 2
    assert "--size" in capsys.readouterr().err


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    def files(path: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(path.iterdir())}

    sc = tiny("mixtral", dtype="bfloat16", max_shard_bytes=100_000)
    a = files(make_model(tmp_path / "a", sc, progress=False))
    b = files(make_model(tmp_path / "b", sc, progress=False))
    c = files(make_model(tmp_path / "c", dataclasses.replace(sc, seed=1), progress=False))
    assert len([n for n in a if n.endswith(".safetensors")]) > 1
    assert a == b
    assert a["config.json"] == c["config.json"] and a != c


def test_existing_output_needs_force_and_crashes_leave_nothing(tmp_path, monkeypatch):
    out = tmp_path / "m"
    sc = tiny("olmoe")
    make_model(out, sc, progress=False)
    with pytest.raises(OutputExistsError, match="--force"):
        make_model(out, sc, progress=False)
    make_model(out, dataclasses.replace(sc, seed=3), progress=False, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no .partial, no .old

    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="config.json"):
        make_model(other, sc, progress=False, force=True)
    assert (other / "keep.txt").read_text() == "mine"

    import sluice.tools.synth as synth

    def boom(sc):
        yield "model.embed_tokens.weight", torch.zeros(3)
        raise RuntimeError("disk full")

    monkeypatch.setattr(synth, "tensors", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        make_model(tmp_path / "crashed", sc, progress=False)
    assert not (tmp_path / "crashed").exists() and not (tmp_path / "crashed.partial").exists()


def _experts_used(path: Path, n_tokens: int = 32) -> list[int]:
    model, _ = hf_load(path)
    ids = torch.randint(3, model.config.vocab_size, (1, n_tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        router_logits = model(ids, output_router_logits=True).router_logits  # per layer [T, E]
    k = model.config.num_experts_per_tok
    return [int(torch.unique(r.topk(k, dim=-1).indices).numel()) for r in router_logits]


def test_default_embed_std_spreads_routing(tmp_path):
    # Small qwen3_moe: 4 layers, 16 experts top-4, hidden 256. Over 32 tokens a trained-like spread uses nearly all.
    sc = SynthConfig(arch="qwen3_moe", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=1, head_dim=64,
                     num_experts=16, top_k=4, moe_intermediate_size=64, vocab_size=1024, dtype="float32")
    spread = _experts_used(make_model(tmp_path / "spread", sc, progress=False))
    narrow = _experts_used(make_model(tmp_path / "narrow", dataclasses.replace(sc, embed_std=0.02), progress=False))
    print(f"experts used per layer over 32 tokens: embed_std 4.0 -> {spread}, 0.02 -> {narrow}")
    assert min(spread) >= 12, spread


def test_cli_writes_a_hybrid_in_the_real_models_proportions(tmp_path, capsys):
    """Qwen3.6-35B-A3B's proportions, scaled down: 3 Gated DeltaNet layers to 1 attention layer, linear attention
    with as many key heads as attention heads and twice the value heads at half the head size, a shared expert of
    one routed expert's size, in the hub's multimodal wrapper."""
    out = tmp_path / "q36"
    rc = cli.main(["make-model", str(out), "--arch", "qwen3_5_moe", "--size", "8MiB", "--layers", "8", "--hidden",
                   "128", "--heads", "4", "--kv-heads", "1", "--head-dim", "64", "--experts", "32", "--top-k", "8",
                   "--no-progress"])
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and "vision_config" in cfg
    text = cfg["text_config"]
    assert text["model_type"] == "qwen3_5_moe_text" and text["layer_types"] == ["linear_attention"] * 3 + [
        "full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    assert (text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]) == (4, 1, 64)
    assert (text["linear_num_key_heads"], text["linear_num_value_heads"], text["linear_key_head_dim"],
            text["linear_value_head_dim"]) == (4, 8, 32, 32)
    assert text["shared_expert_intermediate_size"] == text["moe_intermediate_size"]
    assert (text["num_experts"], text["num_experts_per_tok"]) == (32, 8)
    capsys.readouterr()
    assert cli.main(["inspect", str(out), "--usage-tokens", "0", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["model_type"], info["attention"], info["kv_layers"], info["layers"]) == ("qwen3_5_moe", "hybrid", 2, 8)
