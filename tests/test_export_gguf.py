"""`sluice export-gguf`: the GGUF read back with gguf's own reader holds every tensor under llama.cpp's name, with the
checkpoint's values (stacked experts included), and the tokenizer llama.cpp needs to encode prompts to the same ids."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from sluice import cli  # noqa: E402
from sluice.errors import ConfigError  # noqa: E402
from sluice.tools.gguf_export import ExportError, export_gguf, pre_tokenizer_name, tensor_plan  # noqa: E402
from sluice.quant.tensor import read_tensor  # noqa: E402
from sluice.tools.synth import SynthConfig, make_model  # noqa: E402
from sluice.tokenizer import Tokenizer  # noqa: E402
from sluice.plan import open_index

TINY = SynthConfig(arch="qwen3_moe", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   num_experts=4, top_k=2, moe_intermediate_size=32, vocab_size=300, dtype="bfloat16")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("m") / "tiny", TINY, progress=False)


def _tensors(path) -> dict[str, tuple[str, tuple[int, ...], torch.Tensor]]:
    """name -> (GGML type name, torch-order shape, values as float32) of every tensor in a GGUF file."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        kind = t.tensor_type.name
        raw = np.ascontiguousarray(t.data)
        if kind == "BF16":
            values = torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16).float()
        else:
            values = torch.from_numpy(raw.copy()).float()
        out[t.name] = (kind, shape, values.reshape(shape))
    return out


def _expected(folder) -> dict[str, torch.Tensor]:
    """llama.cpp name -> the checkpoint's values (float32), experts stacked, built independently of the plan."""
    idx = open_index(folder)
    cfg = idx.config
    get = lambda n: read_tensor(idx[n]).float()  # noqa: E731
    want = {"token_embd.weight": get("model.embed_tokens.weight"), "output_norm.weight": get("model.norm.weight"),
            "output.weight": get("lm_head.weight")}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}"
        want[f"blk.{n}.attn_norm.weight"] = get(f"{p}.input_layernorm.weight")
        want[f"blk.{n}.ffn_norm.weight"] = get(f"{p}.post_attention_layernorm.weight")
        want[f"blk.{n}.ffn_gate_inp.weight"] = get(f"{p}.mlp.gate.weight")
        for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output"),
                       ("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):
            want[f"blk.{n}.{gg}.weight"] = get(f"{p}.self_attn.{hf}.weight")
        for hf, gg in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            want[f"blk.{n}.ffn_{gg}_exps.weight"] = torch.stack(
                [get(f"{p}.mlp.experts.{e}.{hf}.weight") for e in range(cfg["num_experts"])])
    return want


@pytest.mark.parametrize("dtype", ["bf16", "f32", "f16"])
def test_round_trip_names_shapes_values(tiny, tmp_path, dtype):
    out = tmp_path / "m.gguf"
    summary = export_gguf(tiny, out, dtype)
    assert out.is_file() and not (tmp_path / "m.gguf.partial").exists()
    got, want = _tensors(out), _expected(tiny)
    assert set(got) == set(want)
    assert summary["tensors"] == len(want)
    E, I, H = TINY.num_experts, TINY.moe_intermediate_size, TINY.hidden_size
    assert got["blk.1.ffn_gate_exps.weight"][1] == (E, I, H)
    assert got["blk.1.ffn_down_exps.weight"][1] == (E, H, I)
    for name, (kind, shape, values) in got.items():
        assert shape == tuple(want[name].shape), name
        one_d_or_router = len(shape) == 1 or name.endswith("ffn_gate_inp.weight")
        assert kind == ("F32" if one_d_or_router else dtype.upper()), name
        if dtype == "f16" and not one_d_or_router:  # bf16 -> f16 rounds: close, not equal
            torch.testing.assert_close(values, want[name], rtol=1e-3, atol=1e-6, msg=name)
        else:  # bf16 bytes copied, or widened to f32: exact
            assert torch.equal(values, want[name]), name


def test_hparams(tiny, tmp_path):
    out = tmp_path / "m.gguf"
    export_gguf(tiny, out, "bf16")
    f = gguf.GGUFReader(out).fields
    kv = lambda k: f[k].contents()  # noqa: E731
    assert kv("general.architecture") == "qwen3moe"
    assert kv("general.file_type") == gguf.LlamaFileType.MOSTLY_BF16
    assert kv("qwen3moe.block_count") == TINY.num_layers
    assert kv("qwen3moe.embedding_length") == TINY.hidden_size
    assert kv("qwen3moe.attention.head_count") == TINY.num_heads
    assert kv("qwen3moe.attention.head_count_kv") == TINY.num_kv_heads
    assert kv("qwen3moe.attention.key_length") == kv("qwen3moe.attention.value_length") == TINY.head_dim
    assert kv("qwen3moe.expert_count") == TINY.num_experts
    assert kv("qwen3moe.expert_used_count") == TINY.top_k
    assert kv("qwen3moe.expert_feed_forward_length") == TINY.moe_intermediate_size
    assert kv("qwen3moe.rope.freq_base") == pytest.approx(1e6)
    assert kv("qwen3moe.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)


def test_tokenizer_metadata(tiny, tmp_path):
    out = tmp_path / "m.gguf"
    export_gguf(tiny, out, "bf16")
    f = gguf.GGUFReader(out).fields
    kv = lambda k: f[k].contents()  # noqa: E731
    tok = Tokenizer.from_folder(tiny)
    cfg = json.loads((tiny / "config.json").read_text())
    tokens, types = kv("tokenizer.ggml.tokens"), kv("tokenizer.ggml.token_type")
    assert kv("tokenizer.ggml.model") == "gpt2" and kv("tokenizer.ggml.pre") == "gpt-2"
    assert len(tokens) == len(types) == cfg["vocab_size"]
    for i, t in enumerate(tokens):  # every id llama.cpp knows is the tokenizer's string for that id, or padding
        assert t == (tok.id_to_token(i) if i < tok.vocab_size else f"[PAD{i}]")
    specials = {tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert all(types[i] == gguf.TokenType.CONTROL for i in specials)
    assert types[10] == gguf.TokenType.NORMAL
    merges = json.loads((tiny / "tokenizer.json").read_text())["model"]["merges"]
    assert kv("tokenizer.ggml.merges") == [m if isinstance(m, str) else " ".join(m) for m in merges]
    assert kv("tokenizer.ggml.eos_token_id") == tok.eos_token_id == cfg["eos_token_id"]
    assert kv("tokenizer.ggml.bos_token_id") == cfg["bos_token_id"]
    assert kv("tokenizer.ggml.padding_token_id") == tok.pad_token_id
    assert kv("tokenizer.ggml.add_bos_token") is False
    assert kv("tokenizer.chat_template") == tok.chat_template


def test_fused_layout_gives_the_same_tensors(tiny, tmp_path):
    fused = make_model(tmp_path / "fused", dataclasses.replace(TINY, layout="fused"), progress=False)
    export_gguf(tiny, tmp_path / "a.gguf", "bf16")
    export_gguf(fused, tmp_path / "b.gguf", "bf16")
    a, b = _tensors(tmp_path / "a.gguf"), _tensors(tmp_path / "b.gguf")
    assert list(a) == list(b)
    for name in a:
        assert a[name][:2] == b[name][:2] and torch.equal(a[name][2], b[name][2]), name


def test_plan_streams_one_tensor_at_a_time(tiny):
    """The plan holds references only (nothing read); an expert stack names its E per-expert sources in order."""
    plan = {t.name: t for t in tensor_plan(open_index(tiny))}
    stack = plan["blk.0.ffn_up_exps.weight"]
    assert [r.name for r in stack.sources] == [f"model.layers.0.mlp.experts.{e}.up_proj.weight"
                                               for e in range(TINY.num_experts)]


def test_unsupported_configs_are_refused(tiny, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny.iterdir():
        (bad / f.name).symlink_to(f)
    cfg = json.loads((tiny / "config.json").read_text())
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps({**cfg, "norm_topk_prob": False}))
    with pytest.raises(ExportError, match="norm_topk_prob"):
        export_gguf(bad, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.partial").exists()
    with pytest.raises(ExportError, match="pre_tokenizer"):
        pre_tokenizer_name({"type": "Whitespace"})


def test_cli(tiny, tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert cli.main(["export-gguf", str(tiny), str(out), "--dtype", "f32", "--json", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["dtype"] == "f32" and summary["bytes"] == out.stat().st_size


def special_outputs(tmp_path) -> list[tuple["Path", str]]:
    """Names an output must never replace, even with --force: (path, what the error calls it)."""
    (tmp_path / "special").mkdir()
    fifo, loop, dangling = (tmp_path / "special" / n for n in ("fifo.gguf", "loop.gguf", "dangling.gguf"))
    os.mkfifo(fifo)
    loop.symlink_to(tmp_path / "special" / "loop2.gguf")
    (tmp_path / "special" / "loop2.gguf").symlink_to(loop)
    dangling.symlink_to(tmp_path / "special" / "nowhere")
    out = [(fifo, "a FIFO"), (loop, "a symbolic link loop"), (dangling, "a symbolic link to a missing target")]
    try:  # as root, export-gguf replaced a device node with its output
        os.mknod(tmp_path / "special" / "dev.gguf", stat.S_IFCHR | 0o600, os.makedev(1, 3))
        out.append((tmp_path / "special" / "dev.gguf", "a character device"))
    except PermissionError:
        pass  # (not root: the FIFO and the links still run)
    return out


def _kinds(paths) -> list[tuple[int, str | None]]:
    return [(os.lstat(p).st_mode, os.readlink(p) if os.path.islink(p) else None) for p in paths]


def test_existing_output_is_kept_unless_forced(tiny, tmp_path, capsys):
    out = tmp_path / "x.gguf"
    out.write_bytes(b"mine")  # export-gguf overwrote it (it had no --force)
    assert cli.main(["export-gguf", str(tiny), str(out), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == f"sluice export-gguf: error: {out} exists; pass --force to replace it"
    assert out.read_bytes() == b"mine"
    assert cli.main(["export-gguf", str(tiny), str(out), "--no-progress", "--force"]) == 0
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == "qwen3moe"
    # a link to a file: --force replaces the link, never the file it points to
    target, link = tmp_path / "target", tmp_path / "link.gguf"
    target.write_bytes(b"kept")
    link.symlink_to(target)
    assert cli.main(["export-gguf", str(tiny), str(link), "--no-progress"]) == 2
    assert cli.main(["export-gguf", str(tiny), str(link), "--no-progress", "--force"]) == 0
    assert not link.is_symlink() and target.read_bytes() == b"kept"


def test_special_outputs_are_never_replaced(tiny, tmp_path, capsys):
    cases = special_outputs(tmp_path)
    before = _kinds([p for p, _ in cases])
    for path, kind in cases:
        for force in ([], ["--force"]):
            assert cli.main(["export-gguf", str(tiny), str(path), "--no-progress", *force]) == 2
            assert capsys.readouterr().err.strip() == (
                f"sluice export-gguf: error: {path} is {kind}, not a file sluice may replace; choose another OUT")
    assert _kinds([p for p, _ in cases]) == before
    assert sorted(os.listdir(tmp_path / "special")) == sorted(p.name for p, _ in cases) + ["loop2.gguf"]


def test_a_partial_name_that_is_not_a_file_is_refused(tiny, tmp_path):
    out = tmp_path / "x.gguf"
    os.mkfifo(tmp_path / "x.gguf.partial")  # opened for writing: blocked forever
    (tmp_path / "y.gguf.partial").symlink_to(tmp_path / "elsewhere")  # followed: written somewhere else
    for name in ("x.gguf", "y.gguf"):
        r = subprocess.run([sys.executable, "-m", "sluice", "export-gguf", str(tiny), str(tmp_path / name),
                            "--no-progress"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.strip() == (
            f"sluice export-gguf: error: {tmp_path / name}.partial exists and is not a file an earlier run left: "
            "move it away")
    assert not out.exists() and not (tmp_path / "elsewhere").exists()


def _with_config(tiny, folder, edit) -> "Path":
    """`tiny`'s files (symlinked) with config.json replaced by edit(config)."""
    folder.mkdir()
    for f in tiny.iterdir():
        (folder / f.name).symlink_to(f)
    cfg = json.loads((tiny / "config.json").read_text())
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(edit(cfg)))
    return folder


def _transformers5(cfg: dict) -> dict:
    """The config as transformers>=5 writes it: num_local_experts, the rope theta inside rope_parameters."""
    cfg = dict(cfg)
    cfg["num_local_experts"] = cfg.pop("num_experts")
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    return cfg


def test_transformers5_spelling_exports_the_same_hparams(tiny, tmp_path):
    """Was refused ("num_experts is missing"), and rope_theta inside rope_parameters was ignored (10000 written)."""
    folder = _with_config(tiny, tmp_path / "t5", _transformers5)
    export_gguf(folder, tmp_path / "m.gguf", "bf16")
    f = gguf.GGUFReader(tmp_path / "m.gguf").fields
    assert f["qwen3moe.expert_count"].contents() == TINY.num_experts
    assert f["qwen3moe.rope.freq_base"].contents() == pytest.approx(1e6)


@pytest.mark.parametrize(
    "edit,needle",
    [
        # transformers' and sluice's default is false: llama.cpp would renormalize what the model does not
        (lambda c: {k: v for k, v in c.items() if k != "norm_topk_prob"}, "norm_topk_prob"),
        # scaled rope written where transformers>=5 puts it was exported as plain rope
        (lambda c: {**_transformers5(c), "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                              "rope_theta": 1e6}}, "rope"),
    ],
)
def test_config_math_llama_cpp_lacks_is_refused(tiny, tmp_path, edit, needle):
    folder = _with_config(tiny, tmp_path / "bad", edit)
    with pytest.raises(ExportError, match=needle):
        export_gguf(folder, tmp_path / "x.gguf")


def test_bad_config_value_is_a_config_error_naming_the_file(tiny, tmp_path):
    folder = _with_config(tiny, tmp_path / "bad", lambda c: {**c, "num_hidden_layers": "2"})
    with pytest.raises(ConfigError) as e:
        export_gguf(folder, tmp_path / "x.gguf")
    assert e.value.field == "num_hidden_layers" and e.value.file == str(folder / "config.json")
