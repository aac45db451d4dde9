"""Numbers that do not depend on timing: sluice against the reference implementations, on the same weights.

    .venv/bin/python benchmarks/quality.py parity               # logits vs transformers, the tiny test checkpoints
    PYTHONPATH=. .venv/bin/python benchmarks/quality.py perplexity [--context 256] [--out benchmarks/results/perplexity]
    benchmarks/peers/.venv/bin/python benchmarks/quality.py quantize IN.gguf OUT.gguf Q4_K_M   # the peers venv
    PYTHONPATH=. .venv/bin/python benchmarks/quality.py imatrix OUT.imatrix [--model DIR] [--chunks 200]
    benchmarks/peers/.venv/bin/python benchmarks/quality.py quantize IN.gguf OUT.gguf IQ2_XXS --imatrix OUT.imatrix

(They were benchmarks/parity.py, benchmarks/perplexity.py and benchmarks/quantized/quantize_llamacpp.py; the
tokenizer's agreement with llama.cpp is benchmarks/tokenizer_llamacpp.py.)

parity: logit parity with transformers on the tiny test checkpoints, per architecture, dtype and expert layout
(tests/models/test_parity.py asserts the bounds; this prints the figures the README quotes). fp32: sluice against
transformers. bf16: the error of sluice's bf16 run and of transformers' own bf16 run against the fp32 model the bf16
weights were rounded from (the test allows sluice at most twice transformers' error).

perplexity: the demo model in twelve GGUF types (bf16 .. tq1_0: benchmarks/perplexity_table.py lists them and who
makes each) on its held-out validation text, by sluice and by llama.cpp on the same GGUF files. Once first: `apt-get install python3.11-doc && python scripts/demo_corpus.py`
(build/demo/corpus/val.jsonl) and `bash benchmarks/peers/setup.sh` (llama-cpp-python in the peers venv). The text: the
14 validation documents of scripts/demo_corpus.py (crc32(path) % 20 == 0, never trained on), joined by blank lines.
The files: `sluice quantize` of sluice/assets/demo (bf16, q8_0, q4_0, mxfp4, tq2_0, tq1_0), and llama.cpp's own
quantizer (`quantize` below on the bf16 file: Q4_K_M, Q3_K_M, IQ4_XS, Q2_K; IQ3_XXS and IQ2_XXS with `imatrix`'s
matrix; the demo's hidden size 256 takes the 256-block types, its expert intermediate 64 does not: llama.cpp falls
back per tensor and says so, and the table lists the types each file's experts got). One definition for both
(sluice/tools/perplexity.py, llama-perplexity's): non-overlapping windows of --context tokens, BOS first when the
tokenizer adds one, the second half of each window scored, log-softmax in float64. llama.cpp's side runs in the peers
venv: `Llama(..., logits_all=True)` evaluates each window from an empty cache and its logits go through the same
scoring function (no timing is taken, so a loaded machine does not change the numbers). Its token ids are compared
with sluice's for the same file. `use_extra_bufts=False`: llama.cpp's repacking buffers raise SIGILL on quantized
files on this CPU family. Default --context 256: the length the demo model was trained on.

quantize: a GGUF quantized by llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize), as the K-quant
and IQ files users download are made; runs in the peers venv (benchmarks/quantized/run.sh makes its Q4_K_M files so).
`--imatrix FILE` passes an importance matrix (`llama-quantize --imatrix`): IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S and
IQ3_XXS are refused without one. llama.h takes it as an array of {name, floats, count} ended by a NULL name
(`llama_model_quantize_params.imatrix`; llama-quant.cpp builds its name -> vector map from it), which ctypes builds
here: no C++ is needed.

imatrix: the importance matrix llama-imatrix would compute (benchmarks/imatrix.py says what each entry holds: per
weight and input column the mean of x^2, per expert over the tokens routed to it), from the model's float32 forward
in transformers over --chunks windows of --context tokens spread evenly over the demo corpus' TRAINING split
(build/demo/corpus/train.jsonl, never the validation text perplexity scores). One command makes a file for the demo:
`PYTHONPATH=. .venv/bin/python benchmarks/quality.py imatrix build/demo.imatrix` (~40 s); then `quantize ...
IQ2_XXS --imatrix build/demo.imatrix`. A missing or malformed file is one line naming it and the entry.

This module imports only the standard library at its top: `quantize` and perplexity's llama.cpp side run in the
peers venv.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PEER_PYTHON = ROOT / "benchmarks/peers/.venv/bin/python"
IMATRIX_CHUNKS = 200  # x 256 tokens = 51,200 of the training split's ~1.0M (llama-imatrix's docs use ~100 x 512)


# -- parity ----------------------------------------------------------------------------------------------------------
def parity(args) -> None:
    """The README's parity table (see the module docstring)."""
    import torch

    import sluice
    from tests.models.tiny import TINY, hf_model, write_checkpoint

    ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(1))
    print("| arch | dtype | layout | sluice max abs diff | transformers' bf16 error | max abs logit |\n"
          "|---|---|---|---|---|---|")
    for arch in sorted(TINY):
        with torch.no_grad():
            exact = hf_model(arch, torch.float32)(ids[None]).logits[0].float()  # the fp32 reference
        for dt in (torch.float32, torch.bfloat16):
            model = hf_model(arch, dt)
            with torch.no_grad():
                ref = model(ids[None]).logits[0].float()
            own = "-" if dt == torch.float32 else f"{(ref - exact).abs().max().item():.2g}"
            for layout in ("per_expert", "fused"):
                folder = write_checkpoint(model, Path(tempfile.mkdtemp()) / arch, layout)
                with sluice.load(folder) as m:
                    diff = (m.logits(ids.tolist()) - exact).abs().max().item()
                print(f"| {arch} | {str(dt)[6:]} | {layout} | {diff:.2g} | {own} | {exact.abs().max().item():.3g} |")


# -- quantize (runs in the peers venv) -------------------------------------------------------------------------------
def quantize(src: Path, dst: Path, kind: str, threads: int | None = None, embed_type: str | None = None,
             requantize: bool = False, imatrix: Path | None = None, tensor_types: list[str] = ()) -> None:
    """llama.cpp's own `kind` (Q4_K_M, Q5_K_M, Q8_0, Q4_0, IQ2_XXS, ...) of the GGUF src, written to dst (what
    `llama-quantize src dst kind` writes); threads: the quantizer's (default: every CPU); embed_type: the token
    embeddings' type, qwen4exp's n-gram table (per_layer_token_embd) included (`llama-quantize
    --token-embedding-type`); requantize: accept an already quantized src (`--allow-requantize`); imatrix: an
    importance matrix file (benchmarks/imatrix.py; `llama-quantize --imatrix`), which IQ1_*, IQ2_XXS/XS/S and IQ3_XXS
    need; tensor_types: "REGEX=TYPE" overrides (`llama-quantize --tensor-type`)."""
    import ctypes

    from benchmarks import imatrix as imx

    try:  # a bad file is one line before llama.cpp loads
        entries = imx.flat(imx.read(imatrix)[0]) if imatrix is not None else None
    except imx.ImatrixError as e:
        raise SystemExit(f"error: {e}") from None
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}", None)
    if ftype is None:
        raise SystemExit(f"error: unknown type {kind!r} (e.g. Q4_K_M, Q3_K_M, Q2_K, IQ4_XS, IQ2_XXS, Q8_0)")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads or os.cpu_count() or 1
    params.allow_requantize = requantize
    if embed_type is not None:
        params.token_embedding_type = getattr(llama_cpp, f"GGML_TYPE_{embed_type.upper()}", None)
        if params.token_embedding_type is None:
            raise SystemExit(f"error: unknown tensor type {embed_type!r} (e.g. Q8_0, F16, BF16)")
    overrides = []
    for spec in tensor_types:
        pattern, _, name = spec.rpartition("=")
        qtype = getattr(llama_cpp, f"GGML_TYPE_{name.upper()}", None)
        if not pattern or qtype is None:
            raise SystemExit(f"error: --tensor-type {spec!r}: want REGEX=TYPE with a ggml type (e.g. "
                             "'ffn_(gate|up)_exps=IQ2_XXS')")
        overrides.append((pattern.encode(), qtype))
    if overrides:  # llama.h: an array of {pattern, type}, ended by a NULL pattern
        Override = llama_cpp.llama_cpp.llama_model_tensor_override
        table_tt = (Override * (len(overrides) + 1))()
        for row, (pattern, qtype) in zip(table_tt, overrides):
            row.pattern, row.type = pattern, qtype
        params.tt_overrides = ctypes.cast(table_tt, ctypes.POINTER(Override))
    if entries is not None:  # llama.h: an array of {name, data, size}, ended by a NULL name
        Entry = llama_cpp.llama_cpp.llama_model_imatrix_data
        table = (Entry * (len(entries) + 1))()  # zeroed: the last entry's name is NULL
        for row, (name, values) in zip(table, entries.items()):
            row.name, row.size = name.encode(), values.size
            row.data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))  # `entries` keeps the floats alive
        params.imatrix = ctypes.cast(table, ctypes.POINTER(Entry))
    tmp = Path(dst).with_name(Path(dst).name + ".partial")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"error: llama_model_quantize returned {rc} (its reason is logged above)")
    os.replace(tmp, dst)


# -- perplexity (benchmarks/perplexity_table.py) ---------------------------------------------------------------------
def val_text(corpus: Path) -> str:
    return corpus_text(corpus, "val")


def perplexity(args) -> None:
    """The perplexity table; --llama-cpp-child: llama.cpp's side, in the peers venv."""
    from benchmarks import perplexity_table

    if args.llama_cpp_child:
        perplexity_table.llama_cpp_child(args.work, args.context, args.threads)
    else:
        perplexity_table.run(args, Path(__file__))


# -- imatrix ---------------------------------------------------------------------------------------------------------
def corpus_text(corpus: Path, split: str) -> str:
    """The documents of scripts/demo_corpus.py's `split` (train / val), joined by blank lines."""
    path = corpus / f"{split}.jsonl"
    if not path.is_file():  # one line, before any file is written
        raise SystemExit(f"quality.py: no {path}: make it once with `python scripts/demo_corpus.py` (it reads "
                         "python3.11-doc), or pass --corpus")
    docs = [json.loads(line)["text"] for line in path.read_text("utf-8").splitlines() if line]
    return "\n\n".join(docs)


def make_imatrix(model: Path, corpus: Path, out: Path, context: int, chunks: int) -> dict:
    """The importance matrix of `model` calibrated on the demo corpus' training split (never the validation text the
    perplexity table scores), written to `out` (benchmarks/imatrix.py); returns its meta."""
    from benchmarks import imatrix as imx

    text = corpus_text(corpus, "train")
    try:
        entries, meta = imx.compute(model, text, context, chunks)
    except imx.ImatrixError as e:
        raise SystemExit(f"quality.py imatrix: {e}") from None
    rel = lambda p: os.path.relpath(p, ROOT) if Path(p).resolve().is_relative_to(ROOT) else str(p)  # noqa: E731
    meta["model"] = rel(model)
    meta["calibration"] = f"{rel(corpus / 'train.jsonl')} (scripts/demo_corpus.py's training split)"
    imx.write(out, entries, meta)
    return meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("parity", help="logits vs transformers on the tiny test checkpoints")
    p = sub.add_parser("perplexity", help="the demo model's perplexity, sluice vs llama.cpp on the same GGUFs")
    p.add_argument("--corpus", type=Path, default=ROOT / "build/demo/corpus")
    p.add_argument("--work", type=Path, default=ROOT / "build/perplexity", help="where the GGUF files are written")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--threads", type=int, default=1,
                   help="threads of each side (default 1: on a shared machine, llama.cpp's and torch's spinning "
                        "thread pools ran 10-20x slower with 2)")
    p.add_argument("--peer-python", type=Path, default=PEER_PYTHON)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/perplexity")
    p.add_argument("--llama-cpp-child", action="store_true", help=argparse.SUPPRESS)
    q = sub.add_parser("quantize", help="llama.cpp's quantizer (run it with the peers venv's python)")
    q.add_argument("src", type=Path)
    q.add_argument("dst", type=Path)
    q.add_argument("kind", help="Q4_K_M, Q5_K_M, Q8_0, Q4_0, ...")
    q.add_argument("--token-embedding-type", metavar="TYPE",
                   help="the token embeddings' type (and qwen4exp's n-gram table's), e.g. Q8_0 (default: kind's)")
    q.add_argument("--allow-requantize", action="store_true", help="accept an already quantized input")
    q.add_argument("--imatrix", type=Path, metavar="FILE",
                   help="importance matrix (`quality.py imatrix`); IQ1_*, IQ2_XXS/XS/S and IQ3_XXS need one")
    q.add_argument("--tensor-type", action="append", default=[], metavar="REGEX=TYPE",
                   help="tensors whose name matches REGEX take TYPE, over kind's choice (`llama-quantize "
                        "--tensor-type`; repeatable, the first match wins): how Unsloth-style mixes are made")
    i = sub.add_parser("imatrix", help="an importance matrix for `quantize --imatrix` (main venv: transformers)")
    i.add_argument("out", type=Path, help="the file to write (.npz, benchmarks/imatrix.py)")
    i.add_argument("--model", type=Path, default=ROOT / "sluice/assets/demo", help="Hugging Face folder")
    i.add_argument("--corpus", type=Path, default=ROOT / "build/demo/corpus", help="its train.jsonl calibrates")
    i.add_argument("--context", type=int, default=256, help="tokens per calibration window")
    i.add_argument("--chunks", type=int, default=IMATRIX_CHUNKS, help="windows, spread evenly over the text")
    i.add_argument("--uniform", type=Path, metavar="GGUF",
                   help="no calibration: ones for every weight of this GGUF's blocks (every input column weighted "
                        "alike), for a model whose architecture the hooks do not know; speed files only")
    a = ap.parse_args()
    if a.what == "quantize":
        quantize(a.src, a.dst, a.kind, embed_type=a.token_embedding_type, requantize=a.allow_requantize,
                 imatrix=a.imatrix, tensor_types=a.tensor_type)
        print(f"{a.dst}: {a.dst.stat().st_size / 1e9:.2f} GB ({a.kind})")
    elif a.what == "imatrix" and a.uniform is not None:
        from benchmarks import imatrix as imx

        try:
            n = imx.write_uniform(a.uniform, a.out)
        except imx.ImatrixError as e:
            raise SystemExit(f"error: {e}") from None
        print(f"{a.out}: ones for the {n} block weights of {a.uniform}")
    elif a.what == "imatrix":
        meta = make_imatrix(a.model, a.corpus, a.out, a.context, a.chunks)
        print(f"{a.out}: {meta['chunks']} windows of {meta['context']} tokens ({meta['tokens']:,} tokens)")
    else:
        {"parity": parity, "perplexity": perplexity}[a.what](a)


if __name__ == "__main__":
    main()
