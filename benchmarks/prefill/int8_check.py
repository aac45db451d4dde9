"""Issue 28 item 5: why sluice --activations int8 picked another second token than llama.cpp after the prefill
bench's 2,048-token prompt (benchmarks/results/prefill/q4km-int8*.md: 7/14 steps agree, the default int16 10/10).
Numbers only, no timing.

    .venv/bin/python benchmarks/prefill/int8_check.py [--model GGUF] [--prompt-tokens 2048] [--seed 0]
        [--peer-python /abs/path/to/peers/.venv/bin/python] [--out benchmarks/results/prefill/int8_check.json]

On the bench's prompt (prompt_tokens ids drawn as sluice/bench/child.py draws them: torch.randint(0, vocab) seeded)
and its second step (the first token after the prompt fed back, as Model.replay feeds it), it compares the logits of
  float32   sluice dtype="float32": the file's own exact dequantization, the reference
  int16     sluice's default (activations "int16")
  int8      sluice activations="int8" (prompt.c's Q4_K kernels on AVX512-VNNI, q8.c's one-plane decode)
  llama.cpp llama-cpp-python on the same file (its defaults first, then use_extra_bufts=False as the bench ran it)
at the last prompt position (token 1) and the decode step (token 2): relative L2 against float32, the top-2 ids and
their margin, and the float32 margin between the tokens the arms disagree on. Then
  hybrids   one arm's prompt (its KV cache) with another's decode step, to tell the prompt's error from the step's
  layers    the residual stream after each layer, int16 and int8 against float32 (all prompt positions, the last
            one, the decode step): where the error grows
  invariance int8 (and int16 beside it) at prefill chunk 512 against one 2,048 chunk, 1 thread against 2, streamed
            (--io direct --memory 512MiB) against resident, each expert coding its own rows against code_rows_once;
            float32 at chunk 512 (the reference's own rounding noise)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
PEERS_Q4 = ROOT / "benchmarks" / "models" / "qwen3_moe-peers" / "model-Q4_K_M.gguf"
ARMS = {"float32": {"dtype": "float32"}, "int16": {}, "int8": {"activations": "int8"}}


# -- llama.cpp (runs in the peers venv: no sluice import) ------------------------------------------------------------
def llama_child(a) -> int:
    """Evaluate the prompt in one eval (n_batch 512, as the bench's peer arm), then the fed token; save both
    positions' logits as float32 [2, V] to a.npy, and with a.all_npy every prompt position's [T, V] from a second
    context that keeps them all (logits_all)."""
    import llama_cpp
    import numpy as np

    ids = json.loads(Path(a.ids).read_text())
    prompt, fed = ids[:-1], ids[-1]
    params = dict(model_path=a.model, n_ctx=max(512, len(ids) + 16), n_batch=512, n_threads=a.threads,
                  n_threads_batch=a.threads, logits_all=False, verbose=False)
    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def model_params():  # use_extra_bufts: a field of llama_model_params that Llama() does not take (peer_child.py)
        p = defaults()
        p.use_extra_bufts = a.extra_bufts == "on"
        return p

    if a.extra_bufts != "default":
        llama_cpp.llama_cpp.llama_model_default_params = model_params
    llm = llama_cpp.Llama(**params)
    llama_cpp.llama_cpp.llama_model_default_params = defaults
    n_vocab = llm.n_vocab()
    out = np.empty((2, n_vocab), dtype=np.float32)
    llm.eval(prompt)
    out[0] = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))
    llm.eval([fed])
    out[1] = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))
    np.save(a.npy, out)
    info = {"version": llama_cpp.__version__, "use_extra_bufts": bool(llm.model_params.use_extra_bufts),
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}
    llm.close()
    if a.all_npy:  # every prompt position's logits: a second context with logits_all
        llama_cpp.llama_cpp.llama_model_default_params = model_params if a.extra_bufts != "default" else defaults
        llm = llama_cpp.Llama(**{**params, "logits_all": True})
        llama_cpp.llama_cpp.llama_model_default_params = defaults
        llm.eval(prompt)
        np.save(a.all_npy, np.asarray(llm.scores[: len(prompt)], dtype=np.float32))
        llm.close()
    print(json.dumps(info))
    return 0


def llama_logits(peer_py: str, model: Path, ids: list[int], extra_bufts: str, threads: int):
    """(logits [2, V], every prompt position's [T, V] (torch float32), info) from llama_child in a fresh process,
    or (None, None, why) when it failed."""
    import numpy as np
    import torch

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "ids.json").write_text(json.dumps(ids))
        npy, all_npy = Path(d) / "logits.npy", Path(d) / "all.npy"
        r = subprocess.run([peer_py, __file__, "llama", "--model", str(model), "--ids", str(Path(d) / "ids.json"),
                            "--npy", str(npy), "--all-npy", str(all_npy), "--extra-bufts", extra_bufts,
                            "--threads", str(threads)], capture_output=True, text=True)
        if r.returncode != 0:
            return None, None, f"exit {r.returncode}: {r.stderr.strip()[-500:]}"
        return (torch.from_numpy(np.load(npy)), torch.from_numpy(np.load(all_npy)),
                json.loads(r.stdout.strip().splitlines()[-1]))


# -- sluice -----------------------------------------------------------------------------------------------------------
class Recorder:
    """generate_step's sampler: keeps each step's logits and feeds `fed` (teacher forcing, as Model.replay)."""

    def __init__(self, fed: int | None):
        self.fed, self.logits = fed, []

    def __call__(self, logits):
        self.logits.append(logits.detach().float().clone())
        return self.fed if self.fed is not None else int(logits.argmax())


class Taps:
    """Per forward pass and layer: the residual stream after the layer and the attention's and the MoE block's outputs
    (float32 copies), from the model's embed / attention / moe calls."""

    def __init__(self, model):
        self.runs: list[list[dict]] = []  # per forward pass, per layer: {"x", "attn", "moe"} [T, H] float32, "ids"
        self.hidden: list = []  # per forward pass: the final-norm hidden states [T, H] it returned
        emb, att, moe, fwd, exp = model.embed, model.attention, model.moe, model.forward, model.experts

        def forward(tokens, pos):
            h = fwd(tokens, pos)
            self.hidden.append(h)
            return h

        def embed(tokens):
            x = emb(tokens)
            self.runs.append([])
            self._x = x.float()
            return x

        def attention(L, x, *rest):
            y = att(L, x, *rest)
            self._attn = y.float()
            self._x = self._x + self._attn  # the model adds in its dtype; the float32 sum is close enough to compare
            return y

        def experts(L, x, ids, weights):
            self._ids = ids.sort(dim=1).values  # [T, K] the experts the router chose, ascending
            return exp(L, x, ids, weights)

        def moe_(L, x):
            y = moe(L, x)
            self._x = self._x + y.float()
            self.runs[-1].append({"x": self._x.clone(), "attn": self._attn, "moe": y.float(), "ids": self._ids})
            return y

        model.embed, model.attention, model.moe, model.forward = embed, attention, moe_, forward
        model.experts = experts


def sluice_run(model: Path, options: dict, prompt: list[int], fed: int | None, taps: bool = False,
               chunk: int | None = None, cache_in=None, tweak=None):
    """Prefill `prompt` then one decode step of `fed` (the argmax when None): {"logits": [2, V], "cache": (k, v) of
    the prompt, "layers": Taps.runs}. With cache_in (k, v), the prompt's positions are written from it instead and
    only the decode step runs (a hybrid: another arm's prompt, this arm's step). The prompt runs as one chunk
    (chunk None), as the bench's did (--prefill-chunk auto came to 3,202 there)."""
    import torch

    import sluice
    from sluice.generate import decode_one, generate_step

    n = len(prompt)
    with sluice.load(model, max_context=n + 17, **{"memory": "all", **options}) as m, torch.inference_mode():
        if tweak:
            tweak(m)
        t = Taps(m.model) if taps else None
        if cache_in is not None:
            k, v = cache_in
            m.cache.k[:, :, :n] = k.to(m.cache.k.dtype)
            m.cache.v[:, :, :n] = v.to(m.cache.v.dtype)
            hidden = decode_one(m.model, fed, n)
            return {"logits": m.model.logits(hidden)[0].float().clone()}
        rec = Recorder(fed)
        passes, fwd = [], m.model.forward

        def forward(tokens, pos):  # counts the prompt's forward passes (its chunks)
            passes.append(int(tokens.shape[0]))
            return fwd(tokens, pos)

        m.model.forward = forward
        list(generate_step(m.model, prompt, rec, max_tokens=2, prefill_chunk=chunk or n))
        out = {"logits": torch.stack(rec.logits), "passes": passes, "threads": torch.get_num_threads(),
               "cache": (m.cache.k[:, :, :n].clone(), m.cache.v[:, :, :n].clone())}
        if t is not None:
            out["layers"] = t.runs
            # every prompt position's logits (Model.logits' computation: the LM head on all rows at once)
            out["all"] = m.model.logits(t.hidden[0]).float()
        return out


# -- measures ---------------------------------------------------------------------------------------------------------
def rel(a, b) -> float:
    """||a - b|| / ||b||"""
    return float((a.double() - b.double()).norm() / b.double().norm())


def top2(x) -> dict:
    v, i = x.topk(2)
    return {"top1": int(i[0]), "top2": int(i[1]), "margin": round(float(v[0] - v[1]), 5)}


def compare(logits: dict, ref: str) -> dict:
    """Per position: each arm's top-2 and relative L2 against `ref`, and each arm's logits of every token some arm
    picks there."""
    out = {}
    for p, name in enumerate(("after prompt (token 1)", "decode step (token 2)")):
        picks = sorted({int(lg[p].argmax()) for lg in logits.values()})
        out[name] = {arm: {**top2(lg[p]),
                           "rel_l2_vs_float32": None if arm == ref else round(rel(lg[p], logits[ref][p]), 6),
                           "logits_of_picks": {str(t): round(float(lg[p][t]), 5) for t in picks}}
                     for arm, lg in logits.items()}
    return out


def positions(every: dict, ref: str) -> dict:
    """Over every prompt position (teacher-forced): each arm's top-1 agreement with `ref`, the relative L2 of its
    logits against ref's per position (median, 90th percentile, max), and ref's top-2 margin where they disagree."""
    import torch

    r = every[ref].double()
    v, _ = r.topk(2, dim=1)
    margin = v[:, 0] - v[:, 1]  # [T]
    out = {"ref_margin": {"median": round(float(margin.median()), 5),
                          "below_0.01": int((margin < 0.01).sum()), "below_0.05": int((margin < 0.05).sum())}}
    for arm, x in every.items():
        if arm == ref:
            continue
        x = x[: r.shape[0]].double()
        e = (x - r).norm(dim=1) / r.norm(dim=1)  # [T]
        differ = x.argmax(1) != r.argmax(1)
        out[arm] = {"positions": r.shape[0], "top1_agree": int((~differ).sum()),
                    "rel_l2": {"median": round(float(e.median()), 6), "p90": round(float(e.quantile(0.9)), 6),
                               "max": round(float(e.max()), 6)},
                    "ref_margin_where_differ": {"max": round(float(margin[differ].max()), 5) if differ.any() else None,
                                                "median": round(float(margin[differ].median()), 5) if differ.any()
                                                else None}}
    if "int8" in every and "int16" in every:
        out["int8 vs int16: same top-1"] = int((every["int8"].argmax(1) == every["int16"].argmax(1)).sum())
    return out


def lscpu() -> dict:
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    return {"model_name": fields.get("Model name", "").strip(), "cpus": os.cpu_count(),
            "flags": [f for f in flags if f == "avx2" or f.startswith(("avx512", "amx"))]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    lp = sub.add_parser("llama", help="(internal) llama.cpp's logits, in the peers venv")
    lp.add_argument("--model", required=True)
    lp.add_argument("--ids", required=True)
    lp.add_argument("--npy", required=True)
    lp.add_argument("--all-npy")
    lp.add_argument("--extra-bufts", choices=("default", "on", "off"), default="default")
    lp.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", type=Path, default=PEERS_Q4)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer-python", default=str(ROOT / "benchmarks" / "peers" / ".venv" / "bin" / "python"))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "prefill" / "int8_check.json")
    p.add_argument("--skip", nargs="*", default=[], choices=("llama", "hybrids", "layers", "invariance"))
    a = p.parse_args()
    if a.cmd == "llama":
        return llama_child(a)

    import sluice  # noqa: F401  before torch: sluice sets torch's OpenMP wait policy
    import torch

    from sluice.options import LoadOptions
    from sluice.plan import plan
    from sluice.quant.native import prompt as native_prompt

    vocab = plan(a.model, LoadOptions(memory="all")).spec.vocab_size
    prompt = torch.randint(0, vocab, (a.prompt_tokens,), generator=torch.Generator().manual_seed(a.seed)).tolist()
    res: dict = {"model": str(a.model.relative_to(ROOT) if a.model.is_relative_to(ROOT) else a.model),
                 "prompt_tokens": a.prompt_tokens, "seed": a.seed, "prompt_head": prompt[:8], "cpu": lscpu(),
                 "int8_prompt_kernels": native_prompt.available(), "torch_threads": torch.get_num_threads()}
    print(json.dumps({k: res[k] for k in ("model", "prompt_head", "cpu", "int8_prompt_kernels")}), flush=True)

    runs = {}
    fed = None
    for arm, opts in ARMS.items():  # float32 first: its token 1 is the one fed to every arm
        runs[arm] = sluice_run(a.model, opts, prompt, fed, taps="layers" not in a.skip)
        if fed is None:
            fed = int(runs[arm]["logits"][0].argmax())
        print(arm, [top2(l) for l in runs[arm]["logits"]], flush=True)
    res["fed_token"] = fed
    logits = {arm: r["logits"] for arm, r in runs.items()}
    every = {arm: r["all"] for arm, r in runs.items() if "all" in r}
    res["llama_cpp"] = {}
    if "llama" not in a.skip:
        for mode in ("default", "off"):
            lg, al, info = llama_logits(a.peer_python, a.model, prompt + [fed], mode, torch.get_num_threads())
            name = "llama.cpp" if mode == "default" else "llama.cpp extra_bufts off"
            res["llama_cpp"][name] = info
            if lg is not None:
                logits[name], every[name] = lg, al
            print(name, info if lg is None else [top2(l) for l in lg], flush=True)
    res["logits"] = compare(logits, "float32")
    if "float32" in every:
        res["all_positions"] = positions(every, "float32")
        for arm, r in res["all_positions"].items():
            print(arm, r, flush=True)

    if "hybrids" not in a.skip:  # prompt (KV cache) of one arm, decode step of another
        hy = {}
        for dec in ARMS:
            for pre in ARMS:
                if pre != dec:
                    lg = sluice_run(a.model, ARMS[dec], prompt, fed, cache_in=runs[pre]["cache"])["logits"]
                    hy[f"{pre} prompt + {dec} step"] = {**top2(lg), "rel_l2_vs_float32": round(
                        rel(lg, logits["float32"][1]), 6)}
                    print(f"{pre} prompt + {dec} step", hy[f"{pre} prompt + {dec} step"], flush=True)
        res["hybrids"] = hy

    if "layers" not in a.skip:  # each layer's residual stream and block outputs against float32's
        ref = runs["float32"]["layers"]

        def errs(arm, L):
            (got, step), (r, r_step) = (runs[arm]["layers"][p][L] for p in (0, 1)), (ref[p][L] for p in (0, 1))
            same = (got["ids"] == r["ids"]).all(1)  # [T] tokens routed to the experts float32 chose
            out = {"layer": L}
            for what in ("x", "attn", "moe"):
                out[f"{what} prompt"] = round(rel(got[what], r[what]), 6)
                out[f"{what} prompt last"] = round(rel(got[what][-1], r[what][-1]), 6)
                out[f"{what} step"] = round(rel(step[what], r_step[what]), 6)
            out["x bf16 rounding"] = round(rel(r["x"].bfloat16().float(), r["x"]), 6)  # float32's, rounded once
            out["rerouted tokens"] = int((~same).sum())
            out["moe prompt same route"] = round(rel(got["moe"][same], r["moe"][same]), 6)
            out["rerouted last, step"] = [bool(not same[-1]), bool(not torch.equal(step["ids"], r_step["ids"]))]
            return out

        res["layers"] = {arm: [errs(arm, L) for L in range(len(ref[0]))] for arm in ("int16", "int8")}
        for arm in ("int16", "int8"):
            for r in res["layers"][arm]:
                print(arm, r, flush=True)

    if "invariance" not in a.skip:  # int8's logits against other chunkings, threads, streaming; int16 beside it,
        def no_code_once(m):         # and float32 at another chunking (how firm the reference's own bits are)
            m.model.code_rows_once = False

        inv = {}
        for arm in ("float32", "int16", "int8"):
            base = runs[arm]["logits"]
            variants = {"chunk 512": dict(chunk=512), "threads 1": dict(options={**ARMS[arm], "threads": 1}),
                        "streamed 512MiB direct": dict(options={**ARMS[arm], "memory": "512MiB", "io": "direct"})}
            if arm == "float32":
                variants = {"chunk 512": variants["chunk 512"]}
            if arm == "int8":
                variants["each expert codes its rows"] = dict(tweak=no_code_once)
            for name, kw in variants.items():
                r = sluice_run(a.model, kw.pop("options", ARMS[arm]), prompt, fed, **kw)
                lg = r["logits"]
                inv[f"{arm}: {name}"] = {"passes": r["passes"], "threads": r["threads"],
                                         "bitwise_equal": bool(torch.equal(lg, base)),
                                         "rel_l2_vs_base": [round(rel(lg[i], base[i]), 8) for i in range(2)],
                                         "tokens": [int(lg[i].argmax()) for i in range(2)]}
                print(f"{arm}: {name}", inv[f"{arm}: {name}"], flush=True)
        res["invariance"] = inv

    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
