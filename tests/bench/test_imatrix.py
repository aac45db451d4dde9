"""benchmarks/imatrix.py (the importance matrix `benchmarks/quality.py imatrix` writes and `quantize --imatrix` hands
to llama.cpp's quantizer): each entry is the mean of x^2 per input column over what that weight multiplies, checked
against values computed another way (transformers' hidden states, the router and the per-expert weights of the
checkpoint's own files); a missing or malformed file is one line naming it; llama.cpp's quantizer makes an IQ2_XXS
file only with a matrix, and uses the one it is given."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import imatrix as imx
from sluice.tokenizer import Tokenizer
from sluice.tools.synth import SynthConfig, make_model

ROOT = Path(__file__).resolve().parents[2]
TEXT = " ".join(f"the value {i} of list {i % 7} is returned by the function" for i in range(400))
CTX, CHUNKS = 32, 6


def tiny(path: Path, hidden: int = 64) -> Path:
    cfg = SynthConfig(arch="qwen3_moe", hidden_size=hidden, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      num_experts=8, top_k=2, moe_intermediate_size=32, vocab_size=300, dtype="float32")
    return make_model(path, cfg, progress=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny(tmp_path_factory.mktemp("im") / "m")


def test_windows_spread_evenly_and_start_with_bos():
    toks = list(range(100))
    assert imx.windows(toks, 10, 3, None) == [toks[0:10], toks[30:40], toks[60:70]]
    assert imx.windows(toks, 40, 5, 7) == [[7, *toks[1:40]], [7, *toks[41:80]]]  # fewer fit than asked: all
    with pytest.raises(imx.ImatrixError, match="fewer than one window of 200"):
        imx.windows(toks, 200, 1, None)


def test_entries_are_the_mean_squares_each_weight_reads(model):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    entries, meta = imx.compute(model, TEXT, CTX, CHUNKS, batch=4)
    tok = Tokenizer.from_folder(model)
    wins = imx.windows(tok.encode(TEXT, add_special_tokens=True), CTX, CHUNKS, None)
    assert meta["chunks"] == len(wins) == CHUNKS and meta["tokens"] == CHUNKS * CTX
    assert len(entries) == 2 * 7  # attn_q, k, v, output and the three expert stacks per layer

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="eager").eval()
    moe_in = {}
    hooks = [layer.post_attention_layernorm.register_forward_hook(
        lambda mod, args, out, n=n: moe_in.setdefault(n, []).append(out.reshape(-1, out.shape[-1])))
        for n, layer in enumerate(hf.model.layers)]
    with torch.no_grad():
        hidden = hf(torch.tensor(wins), output_hidden_states=True).hidden_states  # [B, T, H] per layer input
    for h in hooks:
        h.remove()
    sd = {}  # the checkpoint's own per-expert tensors, not transformers' fused stacks
    for f in sorted(model.glob("*.safetensors")):
        sd.update(load_file(f))
    E, k = 8, 2
    for n, layer in enumerate(hf.model.layers):
        with torch.no_grad():
            x = layer.input_layernorm(hidden[n]).flatten(0, 1).double()
        for proj in ("q", "k", "v"):  # the three read the same normed state
            np.testing.assert_allclose(entries[f"blk.{n}.attn_{proj}.weight"], (x * x).mean(0), rtol=1e-5)
        x = torch.cat(moe_in[n]).double()  # [T, H]: the MoE block's input
        p = f"model.layers.{n}.mlp"
        top = (x @ sd[f"{p}.gate.weight"].double().T).topk(k, dim=-1).indices  # softmax keeps the order
        for e in range(E):
            rows = x[(top == e).any(-1)]
            gate = entries[f"blk.{n}.ffn_gate_exps.weight"][e]
            assert np.array_equal(gate, entries[f"blk.{n}.ffn_up_exps.weight"][e])
            if len(rows) == 0:  # llama-quantize's value for an expert no token reached
                assert (gate == 1).all() and (entries[f"blk.{n}.ffn_down_exps.weight"][e] == 1).all()
                continue
            np.testing.assert_allclose(gate, (rows * rows).mean(0), rtol=1e-4)
            w = {pr: sd[f"{p}.experts.{e}.{pr}_proj.weight"].double() for pr in ("gate", "up")}
            h = torch.nn.functional.silu(rows @ w["gate"].T) * (rows @ w["up"].T)
            np.testing.assert_allclose(entries[f"blk.{n}.ffn_down_exps.weight"][e], (h * h).mean(0), rtol=1e-4)
    assert entries["blk.1.ffn_down_exps.weight"].shape == (E, 32) and entries["blk.0.attn_output.weight"].shape == (64,)


def _write_npz(path: Path, **arrays) -> Path:
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


def test_round_trip_and_bad_files_are_one_line(tmp_path):
    good = {"blk.0.attn_q.weight": np.ones(4, np.float32), "blk.0.ffn_up_exps.weight": np.full((2, 4), 0.5, np.float32)}
    imx.write(tmp_path / "a.imatrix", good, {"chunks": 1})
    entries, meta = imx.read(tmp_path / "a.imatrix")
    assert meta == {"chunks": 1} and {n: v.tolist() for n, v in entries.items()} == {
        n: v.tolist() for n, v in good.items()}
    assert imx.flat(entries)["blk.0.ffn_up_exps.weight"].shape == (8,)
    meta = np.array("{}")
    bad = {
        "missing": tmp_path / "none.imatrix",
        "not a zip": tmp_path / "text.imatrix",
        "no meta": _write_npz(tmp_path / "b", x=np.ones(3, np.float32)),
        "float64": _write_npz(tmp_path / "c", __meta__=meta, **{"blk.0.attn_q.weight": np.ones(3)}),
        "nan": _write_npz(tmp_path / "d", __meta__=meta, **{"blk.0.attn_q.weight": np.array([1, np.nan], "f4")}),
        "3-D": _write_npz(tmp_path / "e", __meta__=meta, **{"blk.0.attn_q.weight": np.ones((1, 1, 2), "f4")}),
    }
    (tmp_path / "text.imatrix").write_text("hello")
    want = {"missing": "no such imatrix file", "not a zip": "not an imatrix file", "no meta": "entry __meta__",
            "float64": "entry blk.0.attn_q.weight: float64 [3]", "nan": "entry blk.0.attn_q.weight: values must be",
            "3-D": "entry blk.0.attn_q.weight: float32 [1, 1, 2]"}
    for case, path in bad.items():
        with pytest.raises(imx.ImatrixError) as e:
            imx.read(path)
        assert str(e.value).startswith(f"{path}: ") and want[case] in str(e.value), case
    # the command says it in one line, before llama.cpp is loaded (this interpreter has none)
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/quality.py"), "quantize", "in.gguf", "out.gguf",
                        "IQ2_XXS", "--imatrix", str(bad["nan"])], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"error: {bad['nan']}: entry blk.0.attn_q.weight: values must be finite and >= 0 (means of squares)"]


@pytest.mark.llama_cpp
def test_llama_cpp_quantizes_iq2_xxs_with_the_matrix_only(tmp_path):
    """Rows of 256 (IQ2_XXS's block): without a matrix llama.cpp refuses; with one it writes IQ2_XXS experts, and a
    different matrix gives different blocks (it is read); sluice runs the file to llama.cpp's greedy tokens."""
    import gguf

    from sluice.tools.quantize import quantize as sluice_quantize
    from tests.checkpoint import llama_cpp

    py = llama_cpp.need_peers()
    src = tiny(tmp_path / "m", hidden=256)
    bf16 = tmp_path / "m-bf16.gguf"
    sluice_quantize(src, bf16, "bf16")
    entries, meta = imx.compute(src, TEXT, CTX, CHUNKS)
    imx.write(tmp_path / "m.imatrix", entries, meta)
    imx.write(tmp_path / "ones.imatrix", {n: np.ones_like(v) for n, v in entries.items()}, meta)

    def run(out: str, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(py), str(ROOT / "benchmarks/quality.py"), "quantize", str(bf16),
                               str(tmp_path / out), "IQ2_XXS", *extra], capture_output=True, text=True, timeout=600)

    r = run("none.gguf")
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("error: llama_model_quantize returned")
    assert "requires an imatrix" in r.stderr and not (tmp_path / "none.gguf").exists()
    for name in ("m", "ones"):
        assert run(f"{name}.gguf", "--imatrix", str(tmp_path / f"{name}.imatrix")).returncode == 0
    tensors = {n: {t.name: (t.tensor_type.name, bytes(t.data)) for t in gguf.GGUFReader(tmp_path / f"{n}.gguf").tensors}
               for n in ("m", "ones")}
    gate = "blk.0.ffn_gate_exps.weight"
    assert tensors["m"][gate][0] == "IQ2_XXS" and tensors["m"][gate][1] != tensors["ones"][gate][1]
    import sluice

    ids = Tokenizer.from_folder(src).encode(TEXT[:200], add_special_tokens=True)
    ref = llama_cpp.greedy(tmp_path / "m.gguf", ids, 8)["tokens"]
    with sluice.load(tmp_path / "m.gguf", memory="all", dtype="float32") as m:
        assert list(m.generate_tokens(ids, max_tokens=8, temperature=0.0, stop_at_eos=False)) == ref


def test_a_uniform_matrix_has_ones_for_every_block_weight_in_the_quantizer_shape(tmp_path):
    """`quality.py imatrix --uniform GGUF` (no calibration, for architectures the hooks do not know): ones of
    [n_in] for a 2-D weight of the blocks and [experts, n_in] for a stacked expert tensor, as llama_model_quantize
    reads them; nothing for the embeddings, the output, norms or biases."""
    from tests.checkpoint.gguf_files import GGUF_TINY, convert
    from tests.models.tiny import hf_model

    model = hf_model("qwen3_moe", **GGUF_TINY["qwen3_moe"])
    path = convert(model, tmp_path / "m.gguf")
    n = imx.write_uniform(path, tmp_path / "u.imatrix")
    entries, meta = imx.read(tmp_path / "u.imatrix")
    assert n == len(entries) and "ones" in meta["calibration"]
    cfg = model.config
    gate = entries["blk.0.ffn_gate_exps.weight"]
    assert gate.shape == (cfg.num_experts, cfg.hidden_size) and (gate == 1).all()
    assert entries["blk.0.ffn_down_exps.weight"].shape == (cfg.num_experts, cfg.moe_intermediate_size)
    assert entries["blk.0.attn_q.weight"].shape == (cfg.hidden_size,)
    assert not any(k.startswith(("token_embd", "output")) or "norm" in k for k in entries)
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf")
    with pytest.raises(imx.ImatrixError, match="bad.gguf: not a readable GGUF file"):
        imx.write_uniform(tmp_path / "bad.gguf", tmp_path / "v.imatrix")
