"""Learned prerouter: fit records the router's true choices, writes a heads file that `prefetch="learned"` loads,
output stays exact, and a missing or stale file is a clean CheckpointError."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

import sluice
from sluice.checkpoint.safetensors import read_header, write_safetensors
from sluice.errors import CheckpointError
from sluice.prerouter.predict import (PREROUTER_FILE, Head, LearnedPrerouter, RouterPrerouter, load_heads,
                              model_fingerprint, next_moe_layers)
from sluice.tools.prerouter_fit import FitOptions, corpus_ids, fit, record
from sluice.tools.tokenizer_train import train_tokenizer
from sluice.models.weights import resident_refs
from sluice.models.layers.norm import rms_norm
from sluice.models.routing import route

from .models.tiny import hf_model, write_checkpoint

IDS = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(3)).tolist()
OPTS = FitOptions(tokens=640, seq_len=128, epochs=6)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: one thread is fastest, and more only contend on a busy CI box (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Tiny qwen3_moe (3 layers, layer 1 dense: heads 0 and 1 both predict layer 2), 8 experts top-2, tokenizer."""
    folder = write_checkpoint(hf_model("qwen3_moe", torch.bfloat16), tmp_path_factory.mktemp("pr"), "per_expert")
    train_tokenizer(folder, vocab_size=300)
    return folder


@pytest.fixture(scope="module")
def fitted(model_dir):
    report = fit(model_dir, OPTS, progress=False)
    return model_dir, report


def _streamed_memory(folder, slots: int) -> int:
    with sluice.load(folder) as m:
        return m.resident_bytes + slots * m.layout.expert_nbytes


def test_fit_writes_heads_and_reports_recall(fitted):
    folder, report = fitted
    path = folder / PREROUTER_FILE
    assert report.path == path and path.is_file()
    assert [(r.source, r.target) for r in report.layers] == [(0, 2), (1, 2)]  # the dense layer 1 is skipped
    _, meta = read_header(path)
    assert meta["kind"] == "linear" and meta["format"].startswith("sluice-prerouter/")
    assert json.loads(meta["report"])["layers"][0]["source"] == 0
    for r in report.layers:
        assert all(0.0 <= v <= 1.0 for v in (*r.router, *r.learned))
        assert r.router[1] >= r.router[0] and r.learned[1] >= r.learned[0]  # a margin only adds candidates
    # Each head starts at the router and keeps the epoch best on validation tokens, so on held-out tokens it should
    # not be much worse; random weights promise no more than that. Measured on this model: 80.5% both at k=2 here
    # (640 tokens: validation keeps the router), 81.3% -> 84.3% with the CLI's default 4096 tokens.
    assert report.mean("learned", 0) >= report.mean("router", 0) - 0.05
    assert report.heldout_tokens == 64 and report.train_tokens == 576


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])  # glm4_moe: the biased, grouped sigmoid router
def test_recorded_ids_are_the_routers_choices(model_dir, tmp_path, arch):
    """The recorder recomputes each MoE layer's top-k from the x it is handed; the store counts what the model
    really acquired: the two histograms agree exactly."""
    if arch != "qwen3_moe":
        model_dir = write_checkpoint(hf_model(arch, torch.bfloat16), tmp_path / arch, "per_expert")
        train_tokenizer(model_dir, vocab_size=300)
    with sluice.load(model_dir, max_context=64) as m:
        ids = corpus_ids(m, None, 96)
        before = m.store.usage.clone()
        rec = record(m, ids, seq_len=64, progress=False)
        used = m.store.usage - before  # [layers, E]
        assert m.model.prerouter is None  # the slot is given back
        for M, true in rec.ids.items():
            assert torch.equal(torch.bincount(true.flatten(), minlength=m.spec.num_experts), used[M])
        # and the model still generates from a clean cache afterwards
        assert len(list(m.generate_tokens(IDS, max_tokens=3, stop_at_eos=False))) == 3


def test_router_start_predicts_like_router_prerouter(model_dir):
    """A head at its starting point (router with the norm folded in, zero bias) ranks like RouterPrerouter."""
    with sluice.load(model_dir, dtype="float32") as m:
        s, w = m.spec, m.model.w
        heads = {L: Head(w.layers[M].router * w.layers[M].post_norm[None, :], torch.zeros(s.num_experts))
                 for L, M in next_moe_layers(s).items()}
        learned, router = LearnedPrerouter(s, heads, margin=1), RouterPrerouter(s, w, margin=1)
        x = torch.randn(16, s.hidden_size, generator=torch.Generator().manual_seed(0))
        for L in range(s.n_layers):
            for t in range(16):
                assert learned.predict(L, x[t : t + 1]) == router.predict(L, x[t : t + 1])


@pytest.mark.parametrize("io", ["direct", "mmap"])
def test_learned_prefetch_keeps_output_exact(fitted, io):
    folder, _ = fitted
    memory = _streamed_memory(folder, 3)  # top_k + 1 slots: prefetch has to evict
    with sluice.load(folder, memory=memory, io=io) as m:
        ref_logits = m.logits(IDS)
        ref = list(m.generate_tokens(IDS, max_tokens=10, stop_at_eos=False))
    with sluice.load(folder, memory=memory, io=io, prefetch="learned", prefetch_margin=1) as m:
        assert isinstance(m.model.prerouter, LearnedPrerouter)
        logits = m.logits(IDS)
        out = list(m.generate_tokens(IDS, max_tokens=10, stop_at_eos=False))
        st = m.stats()
    assert torch.equal(logits, ref_logits)
    assert out == ref
    assert st["prefetch_issued"] > 0 and 0.0 < st["prefetch_recall"] <= 1.0


def test_mlp_heads_and_no_tokenizer(tmp_path):
    """A model without tokenizer.json is recorded on random ids; mlp heads round-trip through the file."""
    folder = write_checkpoint(hf_model("mixtral", torch.bfloat16), tmp_path / "mx", "fused")
    report = fit(folder, FitOptions(tokens=160, seq_len=64, epochs=2, kind="mlp", hidden=16), progress=False)
    assert report.kind == "mlp" and [(r.source, r.target) for r in report.layers] == [(0, 1)]
    with sluice.load(folder, memory=_streamed_memory(folder, 2), prefetch="learned") as m:
        assert m.model.prerouter.heads[0].up.shape == (16, m.spec.hidden_size)
        ids = list(m.generate_tokens(IDS, max_tokens=4, stop_at_eos=False))
    with sluice.load(folder, memory=_streamed_memory(folder, 2)) as m:
        assert list(m.generate_tokens(IDS, max_tokens=4, stop_at_eos=False)) == ids


def test_missing_file_names_it_and_the_fit_command(model_dir, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(model_dir, folder, ignore=shutil.ignore_patterns(PREROUTER_FILE))
    with pytest.raises(CheckpointError) as e:
        sluice.load(folder, memory=_streamed_memory(folder, 2), prefetch="learned")
    assert e.value.file == str(folder / PREROUTER_FILE)
    assert f"sluice prerouter fit {folder}" in str(e.value)


def test_stale_file_is_rejected(fitted, tmp_path):
    folder, _ = fitted
    # same config, other weights: only the routers' hash tells them apart
    other = write_checkpoint(hf_model("qwen3_moe", torch.bfloat16, seed=1), tmp_path / "other", "per_expert")
    shutil.copy(folder / PREROUTER_FILE, other / PREROUTER_FILE)
    with pytest.raises(CheckpointError) as e:
        sluice.load(other, memory=_streamed_memory(other, 2), prefetch="learned")
    assert "stale" in str(e.value) and "routers_sha256" in str(e.value) and "config_sha256" not in str(e.value)
    assert e.value.file == str(other / PREROUTER_FILE) and "sluice prerouter fit" in str(e.value)
    # an edited config.json
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config_sha256"):
        sluice.load(other, memory=_streamed_memory(other, 2), prefetch="learned")


def test_wrong_shapes_and_foreign_files_are_rejected(fitted, tmp_path):
    folder, _ = fitted
    with sluice.load(folder) as m:
        s = m.spec
        fp = model_fingerprint(s, m.index.config, resident_refs(m.index, s, m.arch))
    heads, meta = load_heads(folder / PREROUTER_FILE, s, fp)
    assert set(heads) == {0, 1}
    bad = tmp_path / "bad.safetensors"
    write_safetensors(bad, {"heads.0.weight": torch.zeros(3, 3)}, {"format": "pt"})
    with pytest.raises(CheckpointError, match="not a sluice prerouter file"):
        load_heads(bad, s, fp)
    tensors = {"heads.0.weight": torch.zeros(s.num_experts, s.hidden_size + 1), "heads.0.bias": torch.zeros(8)}
    write_safetensors(bad, tensors, {k: meta[k] for k in ("format", "kind", *fp)})
    with pytest.raises(CheckpointError) as e:
        load_heads(bad, s, fp)
    assert e.value.tensor == "heads.0.weight" and "shape" in str(e.value)


def test_cli_fit_and_learned_run(fitted, tmp_path):
    folder, _ = fitted
    out = tmp_path / "heads.safetensors"
    r = subprocess.run([sys.executable, "-m", "sluice", "prerouter", "fit", str(folder), "--tokens", "200",
                        "--seq-len", "64", "--epochs", "1", "--out", str(out), "--json", "--no-progress",
                        "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["path"] == str(out) and out.is_file()
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare, ignore=shutil.ignore_patterns(PREROUTER_FILE))
    r = subprocess.run([sys.executable, "-m", "sluice", "run", str(bare), "--prompt", "hi", "--prefetch", "learned",
                        "--memory", str(_streamed_memory(bare, 2))], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert PREROUTER_FILE in r.stderr and "sluice prerouter fit" in r.stderr


def test_router_prerouter_follows_the_selection_bias(tmp_path):
    """glm4_moe selects by sigmoid score + e_score_correction_bias: fed the next MoE layer's own input, the
    training-free prerouter (margin 0) predicts exactly the experts the router picks (one expert group, so no group
    limit applies); ranking by the logits alone misses some."""
    folder = write_checkpoint(hf_model("glm4_moe", torch.float32, n_group=1, topk_group=1), tmp_path / "m",
                              "per_expert")
    with sluice.load(folder) as m:
        s, w = m.spec, m.model.w
        pre = RouterPrerouter(s, w)
        x = torch.randn(32, s.hidden_size, generator=torch.Generator().manual_seed(0))
        missed = 0
        for L, M in next_moe_layers(s).items():
            lw = w.layers[M]
            for t in range(32):
                h = rms_norm(x[t : t + 1], lw.post_norm, s.rms_norm_eps)
                true = sorted(route(s, lw, h)[1][0].tolist())
                assert pre.predict(L, x[t : t + 1]) == (M, true)
                logits = torch.nn.functional.linear(h, lw.router)  # [1, E]
                missed += sorted(torch.topk(logits, s.top_k).indices[0].tolist()) != true
        assert missed > 0  # the bias matters on this model


def test_native_guess_ranks_like_torchs_router(model_dir):
    """A bf16 decode token's guess through decode.c's router call (softmax, the same ranking as the logits) picks
    what F.linear's logits pick; a prompt's rows and float32 keep torch's route."""
    from sluice.quant import native

    if not native.available():
        pytest.skip("the native kernels are not built (setup.py build_ext): the guess stays on torch")
    with sluice.load(model_dir) as m:
        s, w = m.spec, m.model.w
        fast, torch_ = RouterPrerouter(s, w, margin=1, path=m.compute.path), RouterPrerouter(s, w, margin=1)
        assert fast.path is not None and torch_.path is None
        x = torch.randn(32, s.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
        same = sum(fast.predict(L, x[t : t + 1]) == torch_.predict(L, x[t : t + 1])
                   for L in next_moe_layers(s) for t in range(32))
        # the logits are rounded to bf16 in another summation order: a near tie may land a bf16 step apart
        assert same >= 0.95 * 32 * len(next_moe_layers(s))
        assert fast.predict(0, x) == torch_.predict(0, x)  # [T, H] with T > 1: torch's route in both


def test_prompt_guess_ranks_on_the_models_gemm(model_dir, monkeypatch):
    """A prompt's guess ranks the next router's logits computed as the true router computes a prompt's (the model's
    Compute.bf16_gemm): without bf16 GEMMs a float32 GEMM of the rows, not torch's bf16 one (on AVX2 it has no native
    kernel: 3.1% of a 2,048-token prompt's CPU); the engine hands both prerouters the model's choice."""
    from sluice.models import routing

    with sluice.load(model_dir, memory=_streamed_memory(model_dir, 2), io="direct", prefetch="router") as m:
        s, w, pre = m.spec, m.model.w, m.model.prompt_prerouter
        assert pre is not None and pre.bf16 is m.compute.bf16_gemm and m.model.prerouter.bf16 is m.compute.bf16_gemm
    x = torch.randn(48, s.hidden_size, generator=torch.Generator().manual_seed(2)).bfloat16()
    seen, rows_linear = [], routing.rows_linear
    monkeypatch.setattr(routing, "rows_linear", lambda *a: seen.append(a[3]) or rows_linear(*a))
    for bf16 in (False, True):
        guess = RouterPrerouter(s, w, bf16=bf16)
        for L, M in next_moe_layers(s).items():
            lw, seen[:] = w.layers[M], []
            logits = rows_linear(rms_norm(x, lw.post_norm, s.rms_norm_eps), lw.router, None, bf16)  # [T, E]
            ids, counts = torch.topk(logits, s.top_k, dim=-1).indices.flatten().unique(return_counts=True)
            assert guess.predict(L, x) == (M, ids[torch.argsort(counts, descending=True, stable=True)].tolist())
            assert seen == [bf16]


def test_a_long_prompts_guess_ranks_evenly_spaced_rows(model_dir):
    """A prompt longer than GUESS_ROWS is guessed from GUESS_ROWS or fewer of its rows, evenly spaced (the guess
    only orders the read-ahead): 600 rows rank as their every third row does; 256 rows or fewer, every row."""
    from sluice.prerouter.predict import GUESS_ROWS
    from sluice.quant.matmul import rows_linear

    with sluice.load(model_dir) as m:
        s, w = m.spec, m.model.w
    pre = RouterPrerouter(s, w, bf16=False)
    x = torch.randn(600, s.hidden_size, generator=torch.Generator().manual_seed(5)).bfloat16()
    assert GUESS_ROWS == 256

    def ranked(L, rows):  # the experts of rows' top-k, the most picked first
        lw = w.layers[next_moe_layers(s)[L]]
        logits = rows_linear(rms_norm(rows, lw.post_norm, s.rms_norm_eps), lw.router, None, False)
        ids, counts = torch.topk(logits, s.top_k, dim=-1).indices.flatten().unique(return_counts=True)
        return ids[torch.argsort(counts, descending=True, stable=True)].tolist()

    for L in next_moe_layers(s):
        assert pre.predict(L, x)[1] == ranked(L, x[::3])
        assert pre.predict(L, x[:256])[1] == ranked(L, x[:256])
        assert pre.predict(L, x[:257])[1] == ranked(L, x[:257:2])


def test_auto_skips_the_guess_while_its_throttle_pauses(model_dir):
    """The default `--prefetch auto` guesses with the router (the same tokens as no read-ahead); while its store's
    throttle pauses, the model does not even compute the guess (store.guessing() False)."""
    from sluice.store.prefetch import PrefetchTracker, Throttle

    memory = _streamed_memory(model_dir, 3)
    with sluice.load(model_dir, memory=memory, io="direct", prefetch="none") as m:
        want = list(m.generate_tokens([1, 2, 3], max_tokens=8, temperature=0.0))
    with sluice.load(model_dir, memory=memory, io="direct") as m:
        assert m.load_plan.prefetch == "auto"
        assert list(m.generate_tokens([1, 2, 3], max_tokens=8, temperature=0.0)) == want
        assert m.store.stats()["prefetch_issued"] > 0
        # a throttle no guess passes: after its first scored read, paused for the rest of the run
        m.store.prefetching = PrefetchTracker(Throttle(precision=1.01, window=1, cooldown=10**6))
        calls, predict = [], m.model.prerouter.predict
        m.model.prerouter.predict = lambda *a: calls.append(a[0]) or predict(*a)
        assert list(m.generate_tokens([1, 2, 3], max_tokens=8, temperature=0.0)) == want
        st = m.store.stats()
    assert st["prefetch_paused"] > 0 and len(calls) <= 4 and st["prefetch_issued"] <= 4
