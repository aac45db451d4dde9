"""config.json validation (models/schema.py): real configs of every architecture are accepted in every spelling;
each bad value is one ConfigError naming the file, the field and the accepted values, before any weight is read."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sluice
from sluice.errors import ConfigError
from sluice.models import model_args, supported
from sluice.models.args import GenerationArgs
from sluice.models.schema import MAX_INT, describe_fields, parse
from sluice.tools.synth import SynthConfig, config_json

from .tiny import TINY, hf_model, write_checkpoint

SRC = "/models/m/config.json"
DEMO = Path(sluice.__file__).parent / "assets" / "demo" / "config.json"


def transformers_saved(arch: str) -> dict:
    """TINY[arch] as transformers>=5 writes it to config.json (num_local_experts, rope_parameters, nulls, ...)."""
    from transformers import AutoConfig

    cfg = dict(TINY[arch])
    return json.loads(AutoConfig.for_model(cfg.pop("model_type"), **cfg).to_json_string())


def spec_of(config: dict, source: str = SRC):
    return model_args(config, source)[1].spec()


def error_of(config: dict, source: str = SRC) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        spec_of(config, source)
    return e.value


def mutated(arch: str, **changes) -> dict:
    cfg = dict(TINY[arch])
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


# -- real configs ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(TINY))
def test_transformers_spelling_gives_the_same_spec(arch):
    """transformers>=5 writes num_local_experts, rope_parameters, head_dim null, sliding_window 0, layer_types:
    the Spec must be the one the hand-written tiny config gives."""
    saved = transformers_saved(arch)
    assert dataclasses.asdict(spec_of(saved)) == dataclasses.asdict(spec_of(TINY[arch]))


@pytest.mark.parametrize("arch", supported())
def test_transformers_defaults_and_synth_configs_are_accepted(arch):
    from transformers import AutoConfig

    spec_of(json.loads(AutoConfig.for_model(arch).to_json_string()))  # every default of the class
    sc = SynthConfig(arch=arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     num_experts=4, top_k=2, moe_intermediate_size=32, vocab_size=300)
    spec_of(config_json(sc))


def test_demo_config_is_accepted():
    spec = spec_of(json.loads(DEMO.read_text()), str(DEMO))
    assert (spec.num_experts, spec.top_k, spec.head_dim, spec.rope.theta) == (32, 4, 64, 1e6)


def test_unknown_keys_are_ignored_and_floats_take_integers():
    cfg = mutated("qwen3_moe", rope_theta=50000, rms_norm_eps=0, some_future_key={"x": [1, 2]})
    cfg["rms_norm_eps"] = 1  # an integer where a float is declared... but 1 is out of range (< 1)
    assert error_of(cfg).field == "rms_norm_eps"
    cfg["rms_norm_eps"] = 0.5
    spec = spec_of(cfg)
    assert spec.rope.theta == 50000.0 and isinstance(spec.rope.theta, float)


# -- the bugs of issue 12 item 4: each was a crash or a silent wrong answer ------------------------------------------

BAD = [
    # (arch, changes, field at fault, text the message must hold)
    ("qwen3_moe", dict(num_experts_per_tok=9), "num_experts_per_tok", "num_experts (8)"),  # RuntimeError in topk
    ("mixtral", dict(num_experts_per_tok=5), "num_experts_per_tok", "num_experts (4)"),
    ("qwen3_moe", dict(hidden_size=64.0), "hidden_size", "write 64, without the decimal point"),  # TypeError
    ("qwen3_moe", dict(num_attention_heads="4"), "num_attention_heads", "(a string)"),
    ("olmoe", dict(intermediate_size=32.5), "intermediate_size", "expected an integer"),
    ("qwen3_moe", dict(num_hidden_layers=0), "num_hidden_layers", "from 1 to"),  # KeyError 'layers.0.q'
    ("qwen3_moe", dict(tie_word_embeddings="false"), "tie_word_embeddings", "true or false"),  # silently tied
    ("qwen3_moe", dict(tie_word_embeddings=0), "tie_word_embeddings", "true or false"),
    ("qwen3_moe", dict(rope_theta=0.0), "rope_theta", "> 1"),  # NaN logits, exit 0
    ("qwen3_moe", dict(rope_theta=-10000.0), "rope_theta", "> 1"),
    ("qwen3_moe", dict(rms_norm_eps=-1e-6), "rms_norm_eps", "> 0"),  # NaN logits, exit 0
    ("qwen3_moe", dict(rms_norm_eps=0), "rms_norm_eps", "> 0"),
]


@pytest.mark.parametrize("arch,changes,field,needle", BAD, ids=[f"{c}" for _, c, _, _ in BAD])
def test_bad_value_names_file_field_and_accepted_values(arch, changes, field, needle):
    e = error_of(mutated(arch, **changes))
    assert (e.file, e.field) == (SRC, field)
    assert SRC in str(e) and repr(field) in str(e) and needle in str(e)


OTHER_BAD = [
    ("qwen3_moe", dict(num_key_value_heads=3), "num_key_value_heads", "divides num_attention_heads (4)"),
    ("mixtral", dict(hidden_size=66), "hidden_size", "multiple of num_attention_heads"),  # no head_dim given
    ("qwen3_moe", dict(head_dim=0), "head_dim", "from 1 to"),
    ("qwen3_moe", dict(head_dim=25), "head_dim", "even head_dim"),  # rope pairs
    ("qwen3_moe", dict(vocab_size=2**64), "vocab_size", f"to {MAX_INT}"),
    ("qwen3_moe", dict(vocab_size=-1), "vocab_size", "from 1 to"),
    ("qwen3_moe", dict(num_experts=None), "num_experts", "expected an integer"),
    ("qwen3_moe", dict(num_experts=...), "num_experts", "missing"),
    ("qwen3_moe", dict(num_experts=8, num_local_experts=4), "num_experts", "keep one"),
    ("qwen3_moe", dict(moe_intermediate_size=[32]), "moe_intermediate_size", "(a list)"),
    ("qwen3_moe", dict(intermediate_size=...), "intermediate_size", "dense"),  # layer 1 is dense
    ("qwen3_moe", dict(mlp_only_layers=[0, 1, 2]), "mlp_only_layers", "at least one MoE layer"),
    ("qwen3_moe", dict(mlp_only_layers=[3]), "mlp_only_layers", "< num_hidden_layers (3)"),
    ("qwen3_moe", dict(mlp_only_layers=[True]), "mlp_only_layers", "a list of integers"),
    ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step", "from 1 to"),  # ZeroDivision in transformers
    ("qwen3_moe", dict(decoder_sparse_step=5), "decoder_sparse_step", "at least one MoE layer"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=0), "sliding_window", "window >= 1"),
    ("mixtral", dict(sliding_window=0), "sliding_window", "from 1 to"),
    ("qwen2_moe", dict(layer_types=["full_attention"] * 2), "layer_types", "of length num_hidden_layers (3)"),
    ("qwen2_moe", dict(layer_types=["full_attention", "local", "full_attention"]), "layer_types", "one of"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=...), "shared_expert_intermediate_size", "missing"),
    ("olmoe", dict(clip_qkv=0.0), "clip_qkv", "> 0"),
    ("olmoe", dict(clip_qkv="8"), "clip_qkv", "a number"),
    ("qwen3_moe", dict(hidden_act="gelu_pytorch_tanh"), "hidden_act", '"silu", "gelu", "relu"'),
    ("qwen3_moe", dict(max_position_embeddings=0), "max_position_embeddings", "from 1 to"),
    ("qwen3_moe", dict(norm_topk_prob="true"), "norm_topk_prob", "true or false"),
    ("qwen2_moe", dict(qkv_bias=None), "qkv_bias", "true or false"),
    ("qwen3_moe", dict(eos_token_id="2"), "eos_token_id", "an integer or a list of integers"),
    ("qwen3_moe", dict(eos_token_id=[2, -1]), "eos_token_id", "each from 0 to"),
    ("qwen3_moe", dict(hidden_size=math.nan), "hidden_size", "expected an integer"),
    ("qwen3_moe", dict(rope_theta=math.inf), "rope_theta", "a number"),
    ("qwen3_moe", dict(partial_rotary_factor=0), "partial_rotary_factor", "> 0 and <= 1"),
    ("qwen3_moe", dict(model_type="llama"), "model_type", "supported: " + ", ".join(supported())),
    ("qwen3_moe", dict(model_type=["qwen3_moe"]), "model_type", "supported"),
]


@pytest.mark.parametrize("arch,changes,field,needle", OTHER_BAD, ids=[f"{c}" for _, c, _, _ in OTHER_BAD])
def test_other_bad_values(arch, changes, field, needle):
    e = error_of(mutated(arch, **changes))
    assert (e.file, e.field) == (SRC, field), str(e)
    assert needle in str(e), str(e)


ROPE_BAD = [
    # (rope dict under rope_parameters, field at fault, text)
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_parameters.rope_type", '"default", "linear", "yarn", "llama3"'),
    ({"type": "longrope"}, "rope_parameters.type", "one of"),
    ({"rope_type": "linear"}, "rope_parameters.factor", "needs factor"),
    ({"rope_type": "linear", "factor": 0.5}, "rope_parameters.factor", ">= 1"),
    ({"rope_type": "linear", "factor": "2"}, "rope_parameters.factor", "(a string)"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0},
     "rope_parameters.original_max_position_embeddings", "from 1 to"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64.0},
     "rope_parameters.original_max_position_embeddings", "an integer"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 0}, "rope_parameters.beta_fast", "> 0"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "no"}, "rope_parameters.truncate", "true or false"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 1e6}, "rope_parameters.attention_factor", "<= 10"),
    ({"rope_type": "yarn", "factor": 4.0, "mscale": 1e300, "mscale_all_dim": 1.0}, "rope_parameters", "scaling"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 1e-320}, "rope_parameters", "non-finite"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0},
     "rope_parameters.high_freq_factor", "> low_freq_factor (4.0)"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0, "high_freq_factor": 4.0},
     "rope_parameters.low_freq_factor", "> 0"),
    ({"rope_type": "default", "rope_theta": 1.0}, "rope_parameters.rope_theta", "> 1"),
    ({"rope_type": "default", "partial_rotary_factor": 0.01}, "rope_parameters.partial_rotary_factor", "rotary"),
    ({"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}},
     "rope_parameters", "per-layer-type"),
    ("yarn", "rope_parameters", "an object"),
]


@pytest.mark.parametrize("rope,field,needle", ROPE_BAD, ids=[json.dumps(r)[:60] for r, _, _ in ROPE_BAD])
def test_bad_rope_parameters(rope, field, needle):
    e = error_of(mutated("qwen2_moe", rope_parameters=rope))
    assert (e.file, e.field) == (SRC, field), str(e)
    assert needle in str(e), str(e)


def test_rope_scaling_is_named_as_spelled_and_wins_like_transformers():
    e = error_of(mutated("qwen3_moe", rope_scaling={"type": "linear", "factor": -2.0}))
    assert e.field == "rope_scaling.factor"
    both = mutated("qwen3_moe", rope_scaling={"rope_type": "linear", "factor": 2.0},
                   rope_parameters={"rope_type": "yarn", "factor": 4.0})
    assert spec_of(both).rope.rope_type == "linear"  # transformers: rope_scaling or rope_parameters


def test_accepted_rope_variants_build():
    for rope in ({"rope_type": "linear", "factor": 2}, {"type": "yarn", "factor": 4.0, "beta_fast": 16},
                 {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 128},
                 {"rope_type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "truncate": False},
                 {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64},
                 {"rope_type": "default", "partial_rotary_factor": 0.5, "rope_theta": 1e6}):
        rc = spec_of(mutated("qwen2_moe", rope_parameters=rope)).rope
        assert rc.rope_type == rope.get("rope_type", rope.get("type"))


def test_generation_config_eos_is_validated():
    src = "/m/generation_config.json"
    assert parse(GenerationArgs, {"eos_token_id": [1, 2], "temperature": 0.7}, source=src).eos_token_id == [1, 2]
    with pytest.raises(ConfigError, match="generation_config.json, field 'eos_token_id'"):
        parse(GenerationArgs, {"eos_token_id": 2.0}, source=src)


def test_every_field_is_documented_with_accepted_values():
    """The schema is introspectable (the README table and new architectures rely on it)."""
    for arch in supported():
        module = __import__(f"sluice.models.{arch}", fromlist=["ModelArgs"])
        rows = {name: (expected, required) for name, expected, required, _ in describe_fields(module.ModelArgs)}
        assert rows["num_experts_per_tok"][1] and "integer" in rows["num_experts_per_tok"][0]
        assert rows["tie_word_embeddings"] == ("true or false", False)


# -- end to end: the errors come out of sluice.load and the CLI, before any weight is read ---------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(hf_model("qwen3_moe"), tmp_path_factory.mktemp("cfg"), "per_expert")


def _copy_with(src: Path, dst: Path, file: str = "config.json", **changes) -> Path:
    """A model folder sharing `src`'s weights (symlinked) with `file` edited."""
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).symlink_to(p)
    cfg = json.loads((src / file).read_text()) if (src / file).exists() else {}
    cfg.update(changes)
    (dst / file).unlink(missing_ok=True)
    (dst / file).write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "file,changes,field",
    [
        ("config.json", dict(num_experts_per_tok=99), "num_experts_per_tok"),  # was RuntimeError in the router
        ("config.json", dict(num_hidden_layers=0), "num_hidden_layers"),  # was KeyError
        ("config.json", dict(hidden_size="64"), "hidden_size"),  # was TypeError
        ("config.json", dict(tie_word_embeddings="false"), "tie_word_embeddings"),  # was silently tied
        ("config.json", dict(rope_parameters={"rope_type": "default", "rope_theta": -1.0}),
         "rope_parameters.rope_theta"),  # was NaN logits
        ("config.json", dict(rms_norm_eps=-0.5), "rms_norm_eps"),  # was NaN logits
        ("generation_config.json", dict(eos_token_id="2"), "eos_token_id"),  # was never matched
    ],
)
def test_load_refuses_bad_config(checkpoint, tmp_path, file, changes, field):
    folder = _copy_with(checkpoint, tmp_path / "m", file, **changes)
    with pytest.raises(ConfigError) as e:
        with sluice.load(folder) as m:
            m.logits([1, 2, 3])
    assert e.value.field == field and e.value.file == str(folder / file)


def test_cli_prints_one_error_line(checkpoint, tmp_path):
    folder = _copy_with(checkpoint, tmp_path / "m", num_experts_per_tok=99)
    r = subprocess.run([sys.executable, "-m", "sluice", "inspect", str(folder)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"sluice inspect: error: file {folder / 'config.json'}, field 'num_experts_per_tok': got 99; expected an "
        "integer from 1 to num_experts (8)"
    ]


def test_valid_edit_still_loads(checkpoint, tmp_path):
    """The same folder with only unknown keys added loads and gives finite logits (the fixture is sound)."""
    folder = _copy_with(checkpoint, tmp_path / "m", some_new_key=[1, {"a": None}], bos_token_id=None)
    with sluice.load(folder) as m:
        assert torch.isfinite(m.logits([1, 2, 3])).all()
