"""GGUFIndex: GGUF files laid out as llama.cpp's converter writes them open as the Hugging Face checkpoint they came
from: the same Spec, every tensor's values under its HF name (Mixtral's q/k un-permuted), the same logits resident
and streamed; split sets; sluice's own export-gguf; and clean errors for what llama.cpp would not run either."""

from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np
import pytest
import torch

import sluice
from sluice.checkpoint.gguf_index import GGUFIndex, gguf_name, hf_name
from sluice.errors import CheckpointError, ConfigError
from sluice.quant.tensor import read_tensor
from sluice.models import get_arch, gguf_archs
from sluice.models.rope import inv_freq
from sluice.store.layout import ExpertLayout
from tests.checkpoint.gguf_files import GGUF_TINY, Q, convert, gguf, kv, raw_gguf, s, tinfo
from tests.models.tiny import hf_model, write_checkpoint
from sluice.plan import open_index

ARCHS = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral"]
IDS = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    """(arch, HF model, HF folder, GGUF file written from the same weights in F32)."""
    arch = request.param
    model = hf_model(arch, **GGUF_TINY[arch])
    root = tmp_path_factory.mktemp(arch)
    folder = write_checkpoint(model, root / "hf", "per_expert")
    path = convert(model, root / "m.gguf", tie=model.config.tie_word_embeddings)
    return arch, model, folder, path


def spec_of(config: dict):
    arch = get_arch(config["model_type"])
    return arch.ModelArgs.from_dict(config).spec()


def assert_same_spec(gguf_config: dict, hf_config: dict) -> None:
    a, b = spec_of(gguf_config), spec_of(hf_config)
    for f in dataclasses.fields(a):
        if f.name != "rope":
            assert getattr(a, f.name) == getattr(b, f.name), f.name
    for f in ("theta", "head_dim", "max_position_embeddings", "rope_type", "partial_rotary_factor"):
        assert getattr(a.rope, f) == getattr(b.rope, f), f
    fa, sa = inv_freq(a.rope)
    fb, sb = inv_freq(b.rope)
    assert torch.equal(fa, fb) and sa == sb


def test_config_matches_the_hf_config(pair):
    arch, model, folder, path = pair
    index = open_index(path)
    assert isinstance(index, GGUFIndex) and index.folder == path and index.files == [path]
    assert index.config["model_type"] == arch and index.generation_config is None
    assert_same_spec(index.config, json.loads((folder / "config.json").read_text()))
    assert index.config["bos_token_id"] == 1 and index.config["eos_token_id"] == 2


def test_every_tensor_holds_the_hf_values(pair):
    arch, model, _, path = pair
    index = open_index(path)
    sd = model.state_dict()
    for name, t in sd.items():
        if ".experts." in name or (name == "lm_head.weight" and model.config.tie_word_embeddings):
            continue
        got = read_tensor(index[name])
        assert torch.equal(got, t.reshape(got.shape)), name  # mixtral q/k: un-permuted by read_tensor
    for n in range(model.config.num_hidden_layers):
        gu = sd[f"model.layers.{n}.mlp.experts.gate_up_proj"]
        i = gu.shape[1] // 2
        p = f"model.layers.{n}.mlp.experts"
        assert torch.equal(read_tensor(index[f"{p}.gate_proj"]), gu[:, :i])
        assert torch.equal(read_tensor(index[f"{p}.up_proj"]), gu[:, i:])
        assert torch.equal(read_tensor(index[f"{p}.down_proj"]), sd[f"{p}.down_proj"])
    q = index["model.layers.0.self_attn.q_proj.weight"]
    assert q.name == "blk.0.attn_q.weight"  # errors name the tensor as the file has it
    assert q.rope_heads == (model.config.num_attention_heads if arch == "mixtral" else 0)


def test_expert_layout_reads_stacked_experts(pair):
    arch, model, _, path = pair
    index = open_index(path)
    mod = get_arch(arch)
    spec = spec_of(index.config)
    layout = ExpertLayout(index, spec, mod)
    assert layout.kind == "stacked" and layout.fused
    sd = model.state_dict()
    for layer, e in ((0, 0), (1, spec.num_experts - 1)):
        buf = bytearray(layout.slot_nbytes)  # one expert's slot: gate, up, down as stored
        for part in layout.parts(layer, e):
            with open(part.range.path, "rb") as f:
                f.seek(part.range.offset)
                data = f.read(part.range.nbytes)
            buf[part.dest_offset:part.dest_offset + len(data)] = data
        fmt = layout.format(layer)
        values = torch.frombuffer(buf, dtype=torch.float32)
        gu = values[: fmt.down_offset // 4].view(layout.gate_up_shape)
        dn = values[fmt.down_offset // 4 :].view(layout.down_shape)
        assert torch.equal(gu, sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"][e])
        assert torch.equal(dn, sd[f"model.layers.{layer}.mlp.experts.down_proj"][e])


def test_logits_equal_the_hf_folder_resident_and_streamed(pair):
    arch, _, folder, path = pair
    with sluice.load(folder, memory="all") as m:
        want = m.logits(IDS)
        memory = m.resident_bytes + m.spec.top_k * m.layout.expert_nbytes
    with sluice.load(path, memory="all") as m:
        assert torch.equal(m.logits(IDS), want)
    with sluice.load(path, memory=memory, io="direct") as m:
        assert torch.equal(m.logits(IDS), want)


def test_fused_gate_up_exps(tmp_path):
    model = hf_model("qwen2_moe", **GGUF_TINY["qwen2_moe"])
    folder = write_checkpoint(model, tmp_path / "hf", "per_expert")
    path = convert(model, tmp_path / "f.gguf", tie=True, fuse_gate_up=True)
    index = open_index(path)
    assert index.gguf_names["model.layers.0.mlp.experts.gate_up_proj"] == "blk.0.ffn_gate_up_exps.weight"
    with sluice.load(folder, memory="all") as a, sluice.load(path, memory="all") as b:
        assert b.layout.kind == "fused"
        assert torch.equal(a.logits(IDS), b.logits(IDS))


def test_tied_embeddings(tmp_path):
    model = hf_model("qwen3_moe", **GGUF_TINY["qwen3_moe"])
    index = open_index(convert(model, tmp_path / "t.gguf", tie=True))
    assert index.config["tie_word_embeddings"] is True and "lm_head.weight" not in index


def test_split_set_equals_single_file(tmp_path):
    model = hf_model("mixtral", **GGUF_TINY["mixtral"])
    single = open_index(convert(model, tmp_path / "one.gguf"))
    first = convert(model, tmp_path / "m.gguf", split_max_tensors=8)
    assert first.name == "m-00001-of-00003.gguf"
    split = open_index(first)
    assert len(split.files) == 3 and split.config == single.config and set(split.tensors) == set(single.tensors)
    for name in single.tensors:
        assert torch.equal(read_tensor(split[name]), read_tensor(single[name])), name
    with sluice.load(single.folder, memory="all") as a, sluice.load(first, memory="all") as b:
        assert torch.equal(a.logits(IDS), b.logits(IDS))


@pytest.fixture
def split_set(tmp_path):
    model = hf_model("olmoe", **GGUF_TINY["olmoe"])
    first = convert(model, tmp_path / "m.gguf", split_max_tensors=10)
    return first, sorted(tmp_path.glob("m-*.gguf"))


def test_split_errors(split_set, tmp_path):
    first, files = split_set
    n = len(files)
    assert n >= 3 and first == files[0]
    with pytest.raises(CheckpointError, match=rf"is split 2 of {n}; open the first split, m-00001-of-0000{n}.gguf"):
        open_index(files[1])
    stray = tmp_path / f"m-0000{n + 1}-of-0000{n}.gguf"
    stray.write_bytes(files[-1].read_bytes())
    with pytest.raises(CheckpointError, match=rf"is split {n + 1} of a {n}-split set; a stray file") as e:
        open_index(first)
    assert e.value.file == str(stray)
    stray.unlink()
    renamed = first.rename(tmp_path / "model.gguf")
    with pytest.raises(CheckpointError, match=rf"its name must end in -00001-of-0000{n}.gguf"):
        open_index(renamed)
    renamed.rename(first)
    files[2].unlink()
    with pytest.raises(CheckpointError, match=rf"split 3 of {n} is missing") as e:
        open_index(first)
    assert e.value.file == str(files[2])


def _patch(path, old: bytes, new: bytes) -> None:
    raw = path.read_bytes()
    assert raw.count(old) == 1
    path.write_bytes(raw.replace(old, new))


def test_split_metadata_must_agree(split_set):
    first, files = split_set
    _patch(files[1], s("split.no") + struct.pack("<IH", 2, 1), s("split.no") + struct.pack("<IH", 2, 2))
    with pytest.raises(CheckpointError, match=rf"split.no is 2, expected 1 for split 2 of {len(files)}") as e:
        open_index(first)
    assert e.value.file == str(files[1])
    _patch(files[1], s("split.no") + struct.pack("<IH", 2, 2), s("split.no") + struct.pack("<IH", 2, 1))
    n = sum(len(gguf.GGUFReader(f).tensors) for f in files)
    count = s("split.tensors.count")
    _patch(first, count + struct.pack("<Ii", 5, n), count + struct.pack("<Ii", 5, n + 1))
    with pytest.raises(CheckpointError, match=r"split.tensors.count \d+ differs from the first split's"):
        open_index(first)


def test_named_as_a_split_without_split_metadata(tmp_path):
    model = hf_model("olmoe", **GGUF_TINY["olmoe"])
    path = convert(model, tmp_path / "x.gguf").rename(tmp_path / "x-00001-of-00002.gguf")
    with pytest.raises(CheckpointError, match=r"named as split 1 of 2 but has no split.count"):
        open_index(path)


def test_a_tensor_in_two_splits(tmp_path):
    def shard(no: int) -> bytes:
        kvs = [kv("general.architecture", 8, s("qwen3moe")), kv("split.no", 2, struct.pack("<H", no)),
               kv("split.count", 2, struct.pack("<H", 2))]
        return raw_gguf(kvs, [tinfo("token_embd.weight", (8,), 0, 0)], b"\0" * 32)

    (tmp_path / "d-00001-of-00002.gguf").write_bytes(shard(0))
    (tmp_path / "d-00002-of-00002.gguf").write_bytes(shard(1))
    with pytest.raises(CheckpointError, match=r"also stored in d-00001-of-00002.gguf") as e:
        open_index(tmp_path / "d-00001-of-00002.gguf")
    assert e.value.tensor == "token_embd.weight"


def test_export_gguf_round_trip_config(tmp_path):
    """transformers' tiny qwen3_moe -> sluice export-gguf -> this reader: the Spec the math uses is the same, and so
    are the logits (bf16 bytes are copied; norms and router are widened to F32 exactly). Also the regression test of
    export-gguf on transformers>=5 configs (num_local_experts; rope_theta inside rope_parameters, which it exported
    as 10000)."""
    from sluice.tools.gguf_export import export_gguf
    from sluice.tools.tokenizer_train import train_tokenizer

    model = hf_model("qwen3_moe", torch.bfloat16, **GGUF_TINY["qwen3_moe"])
    folder = write_checkpoint(model, tmp_path / "hf", "per_expert")
    train_tokenizer(folder, vocab_size=300)
    out = tmp_path / "m.gguf"
    export_gguf(folder, out, "bf16")
    index = open_index(out)
    hf_config = json.loads((folder / "config.json").read_text())
    assert_same_spec(index.config, hf_config)
    for key in ("vocab_size", "moe_intermediate_size", "head_dim", "rms_norm_eps", "max_position_embeddings",
                "norm_topk_prob", "num_experts_per_tok"):  # beside the Spec: the config values themselves
        assert index.config[key] == hf_config[key], key
    assert index.config["rope_theta"] == hf_config["rope_parameters"]["rope_theta"] == 50000.0
    with sluice.load(folder, memory="all") as a, sluice.load(out, memory="all") as b:
        assert torch.equal(a.logits(IDS), b.logits(IDS))


def test_quantized_file_opens_and_loads(tmp_path):
    model = hf_model("qwen3_moe", **GGUF_TINY["qwen3_moe"])

    def pick(name: str):
        return Q.F32 if name.endswith("ffn_gate_inp.weight") else Q.Q8_0 if "exps" in name else Q.Q4_0

    path = convert(model, tmp_path / "q.gguf", qtype=pick)
    index = open_index(path)
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for hname, ref in index.tensors.items():
        t = reader[index.gguf_names[hname]]
        assert (ref.offset, ref.nbytes, ref.dtype) == (t.data_offset, t.n_bytes, t.tensor_type.name), hname
    assert index["model.layers.0.mlp.experts.gate_proj"].dtype == "Q8_0"
    assert index["model.layers.0.self_attn.q_proj.weight"].quantized
    with sluice.load(path, memory="all", dtype="float32") as m:  # block formats are dequantized (tests/quant)
        assert torch.isfinite(m.logits(IDS)).all()


# -- names -------------------------------------------------------------------------------------------------------------
def test_names_round_trip():
    facts = gguf_archs()
    for arch in facts.values():
        for g in arch.tensors:
            h = hf_name(f"blk.3.{g}", arch, 4)
            assert h is not None and gguf_name(h, arch) == f"blk.3.{g}"
        assert hf_name("blk.4.attn_q.weight", arch, 4) is None  # past block_count
        assert hf_name("blk.03.attn_q.weight", arch, 4) is None
    assert hf_name("blk.0.attn_q_norm.weight", facts["llama"], 4) is None
    assert (hf_name("blk.0.ffn_gate_inp_shexp.weight", facts["qwen2moe"], 4)
            == "model.layers.0.mlp.shared_expert_gate.weight")


def test_shared_expert_gate_is_read_1_by_h(pair):
    """llama.cpp stores the gate [H]; the index keeps the file's shape and the model reads it as transformers'
    [1, H] (a squeezed size-1 dim: models/weights.py), the same bytes."""
    from sluice.models.weights import resident_refs

    arch, model, _, path = pair
    if arch != "qwen2_moe":
        pytest.skip(f"{arch} has no shared expert gate (qwen2_moe's)")
    index = open_index(path)
    H = model.config.hidden_size
    assert index["model.layers.0.mlp.shared_expert_gate.weight"].shape == (H,)
    refs = resident_refs(index, spec_of(index.config), get_arch(arch))
    assert refs["layers.0.shared_gate"].shape == (1, H)
    assert torch.equal(read_tensor(refs["layers.0.shared_gate"]),
                       model.state_dict()["model.layers.0.mlp.shared_expert_gate.weight"])


# -- errors ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return hf_model("qwen3_moe", **GGUF_TINY["qwen3_moe"])


def _with(model, tmp_path, change, **kw):
    return convert(model, tmp_path / "e.gguf", extra=change, **kw)


def _set(key, adder, *value):
    return lambda w: (w.kv_data[0].pop(key, None), getattr(w, adder)(key, *value))


def test_unsupported_architectures(qwen3, tmp_path):
    path = _with(qwen3, tmp_path, _set("general.architecture", "add_string", "gemma3"))
    with pytest.raises(ConfigError, match=r"architecture 'gemma3' is not supported; supported \(llama.cpp's name and "
                                          r"config.json model_type\): deepseek2 \(deepseek_v3\), glm4moe "
                                          r"\(glm4_moe\), gpt-oss \(gpt_oss\), llama \(mixtral\), olmoe \(olmoe\), "
                                          r"qwen2moe \(qwen2_moe\), qwen35moe \(qwen3_5_moe\), qwen3moe \(qwen3_moe\), "
                                          r"qwen3next \(qwen3_next\)"):
        open_index(path)
    dense = _with(qwen3, tmp_path, lambda w: (_set("general.architecture", "add_string", "llama")(w),
                                              w.kv_data[0].pop("qwen3moe.expert_count")))
    with pytest.raises(ConfigError, match=r"llama GGUF without experts .* is a dense model"):
        open_index(dense)


@pytest.mark.parametrize("change,error,pattern", [
    (lambda w: w.kv_data[0].pop("qwen3moe.block_count"), CheckpointError, r"metadata qwen3moe.block_count is missing"),
    (_set("qwen3moe.block_count", "add_string", "2"), CheckpointError,
     r"qwen3moe.block_count must be an integer, got a str"),
    (_set("qwen3moe.block_count", "add_uint32", 0), ConfigError, r"qwen3moe.block_count is 0; it must be >= 1"),
    (_set("qwen3moe.expert_used_count", "add_uint32", 9), ConfigError, r"expert_used_count 9 exceeds"),
    (_set("qwen3moe.attention.value_length", "add_uint32", 8), ConfigError, r"value_length is 8 but the head size"),
    (_set("qwen3moe.attention.head_count_kv", "add_array", [2, 1, 2]), ConfigError, r"head_count_kv varies per layer"),
    (_set("qwen3moe.expert_weights_norm", "add_bool", False), ConfigError,
     r"expert_weights_norm is False, but llama.cpp's qwen3moe graph always computes it as True"),
    (_set("qwen3moe.expert_gating_func", "add_uint32", 2), ConfigError, r"a router other than softmax"),
    (_set("qwen3moe.rope.scaling.type", "add_string", "longrope"), ConfigError,
     r"rope.scaling.type is 'longrope'; supported: none, linear, yarn"),
    (_set("qwen3moe.attention.layer_norm_rms_epsilon", "add_float32", float("nan")), ConfigError,
     r"layer_norm_rms_epsilon is nan; it must be a finite number > 0"),
    (_set("qwen3moe.rope.freq_base", "add_float32", 0.0), ConfigError, r"rope.freq_base is 0.0; it must be"),
    (_set("tokenizer.ggml.tokens", "add_array", [1, 2]), CheckpointError,
     r"tokenizer.ggml.tokens must be an array of strings"),
])
def test_metadata_errors(qwen3, tmp_path, change, error, pattern):
    path = _with(qwen3, tmp_path, change)
    with pytest.raises(error, match=pattern) as e:
        open_index(path)
    assert str(path) in str(e.value)


def test_uniform_per_layer_array_is_accepted(qwen3, tmp_path):
    path = _with(qwen3, tmp_path, _set("qwen3moe.attention.head_count_kv", "add_array", [2, 2, 2]))
    assert open_index(path).config["num_key_value_heads"] == 2


def test_rope_scaling_keys(qwen3, tmp_path):
    def yarn(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(64)
        w.add_rope_scaling_yarn_beta_fast(16.0)

    cfg = open_index(_with(qwen3, tmp_path, yarn)).config
    assert cfg["rope_parameters"] == {"rope_theta": 50000.0, "rope_type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 64, "beta_fast": 16.0}
    cfg = open_index(_with(qwen3, tmp_path, _set("qwen3moe.rope.scale_linear", "add_float32", 2.0))).config
    assert cfg["rope_parameters"] == {"rope_theta": 50000.0, "rope_type": "linear", "factor": 2.0}


def test_unknown_and_missing_tensors(qwen3, tmp_path):
    path = _with(qwen3, tmp_path, lambda w: w.add_tensor("blk.0.ffn_gate.weight", np.ones((4, 64), np.float32)))
    with pytest.raises(CheckpointError, match=r"is not part of a qwen3moe model \(qwen3_moe\) with 3 layers") as e:
        open_index(path)
    assert e.value.tensor == "blk.0.ffn_gate.weight"
    path = _with(qwen3, tmp_path, lambda w: w.add_tensor("rope_freqs.weight", np.ones(4, np.float32)))
    with pytest.raises(CheckpointError, match=r"per-dimension rope factors"):
        open_index(path)
    path = _with(qwen3, tmp_path, lambda w: w.add_tensor("blk.0.ffn_up.3.weight", np.ones(4, np.float32)))
    with pytest.raises(CheckpointError, match=r"old per-expert Mixtral layout"):
        open_index(path)
    index = open_index(convert(qwen3, tmp_path / "ok.gguf"))
    del index.tensors["model.layers.2.mlp.gate.weight"]
    with pytest.raises(CheckpointError, match=r"GGUF tensor 'blk.2.ffn_gate_inp.weight' is missing") as e:
        index["model.layers.2.mlp.gate.weight"]
    assert e.value.file == str(index.folder)


def test_cli_takes_a_gguf(qwen3, tmp_path):
    import subprocess
    import sys

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "sluice", *args], capture_output=True, text=True, timeout=300)

    r = cli("inspect", str(convert(qwen3, tmp_path / "m.gguf")), "--json", "--memory", "all")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["model_type"] == "qwen3_moe" and info["expert_layout"] == "stacked" and info["dtype"] == "F32"
    quantized = convert(qwen3, tmp_path / "q.gguf", qtype=lambda name: Q.Q8_0)
    r = cli("inspect", str(quantized), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["dtype"] == "Q8_0"  # experts are reported in their stored format
