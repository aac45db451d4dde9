"""`benchmarks/quality.py perplexity`: the demo model's perplexity on its held-out validation text, by sluice and by
llama.cpp on the same GGUF files (quality.py's docstring says how; this module runs it and writes the table).

The files (FILES, the table's order): `sluice quantize` of sluice/assets/demo to bf16, q8_0, q4_0, mxfp4, tq2_0 and
tq1_0 (tools/quantize.py), and llama.cpp's own quantizer (quality.py `quantize`, llama_model_quantize) from the bf16
file to Q4_K_M, Q3_K_M, IQ4_XS and Q2_K without an importance matrix and IQ3_XXS, IQ2_XXS with one (quality.py
`imatrix`: the demo corpus' training split, written to WORK/demo.imatrix). The demo's hidden size 256 takes the
256-block types; its expert intermediate 64 does not: llama.cpp falls back per tensor (IQ4_NL, Q4_0, Q5_0, ...) and
sluice's ternary files keep those rows F16, so each row says which types the expert tensors got, as the file's header
says (the `gguf` package's reader) and as sluice reads them.

Imports only the standard library at its top: the llama.cpp side runs in the peers venv.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLUICE_FILES = ("bf16", "q8_0", "q4_0", "mxfp4", "tq2_0", "tq1_0")  # `sluice quantize --to`
LLAMA_FILES = {"Q4_K_M": False, "Q3_K_M": False, "IQ4_XS": False, "Q2_K": False,  # llama.cpp's; True: with imatrix
               "IQ3_XXS": True, "IQ2_XXS": True}
FILES = ("bf16", "q8_0", "Q4_K_M", "q4_0", "IQ4_XS", "mxfp4", "Q3_K_M", "IQ3_XXS", "Q2_K", "IQ2_XXS", "tq2_0",
         "tq1_0")
COMMAND = "PYTHONPATH=. .venv/bin/python benchmarks/quality.py perplexity"


def ids_digest(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


# -- llama.cpp (runs in the peers venv) ------------------------------------------------------------------------------
def _llama(path: Path, context: int, threads: int):
    import llama_cpp

    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def no_extra_bufts():  # a field Llama() takes no argument for: set it in the defaults it starts from
        p = defaults()
        if hasattr(p, "use_extra_bufts"):
            p.use_extra_bufts = False
        return p

    llama_cpp.llama_cpp.llama_model_default_params = no_extra_bufts
    try:
        return llama_cpp.Llama(model_path=str(path), n_ctx=context, n_batch=context, n_ubatch=context,
                               logits_all=True, n_threads=threads, n_threads_batch=threads, verbose=False)
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = defaults


def llama_cpp_child(work: Path, context: int, threads: int) -> None:
    """llama.cpp's files (LLAMA_FILES, from work/demo-bf16.gguf), then its perplexity of every file in FILES, each
    written to work/llamacpp-NAME.json."""
    import llama_cpp
    import numpy as np
    import torch

    from benchmarks.quality import quantize
    from sluice.tools.perplexity import bos_of, perplexity

    for kind, needs_imatrix in LLAMA_FILES.items():
        if not (work / f"demo-{kind}.gguf").exists():
            quantize(work / "demo-bf16.gguf", work / f"demo-{kind}.gguf", kind, threads=2,
                     imatrix=work / "demo.imatrix" if needs_imatrix else None)
    text = (work / "val.txt").read_text("utf-8")
    for name in FILES:
        done = work / f"llamacpp-{name}.json"
        if done.exists():
            continue
        llm = _llama(work / f"demo-{name}.gguf", context, threads)
        encode = lambda t, special: llm.tokenize(t.encode("utf-8"), add_bos=special, special=False)  # noqa: E731
        tokens = encode(text, True)

        def logits(ids):
            llm.reset()
            llm.eval(ids)
            return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))  # [T, V]

        t0 = time.perf_counter()
        res = perplexity(logits, tokens, context, bos=bos_of(encode))
        row = {**res.as_dict(), "ids": ids_digest(tokens), "n_ids": len(tokens), "version": llama_cpp.__version__,
               "seconds": round(time.perf_counter() - t0, 1)}
        done.write_text(json.dumps(row, indent=2) + "\n")
        print(f"llama.cpp {name}: {res.perplexity:.4f}", file=sys.stderr)
        llm.close()


# -- sluice ---------------------------------------------------------------------------------------------------------
def sluice_perplexity(path: Path, text: str, context: int, dtype: str, threads: int,
                      activations: str = "auto") -> dict:
    import sluice
    from sluice.tools.perplexity import bos_of, perplexity

    with sluice.load(path, memory="all", dtype=dtype, max_context=context, threads=threads,
                     activations=activations) as m:
        tokens = m.tokenizer.encode(text, add_special_tokens=True)
        t0 = time.perf_counter()
        res = perplexity(m.logits, tokens, context, bos=bos_of(m.tokenizer.encode))
        formats, coding = m.layout.format_names, m.load_plan.activations
    return {**res.as_dict(), "ids": ids_digest(tokens), "n_ids": len(tokens), "expert_formats": formats,
            "activations": coding, "seconds": round(time.perf_counter() - t0, 1)}


def make_files(work: Path, corpus: Path) -> None:
    """sluice's GGUFs of the demo model (SLUICE_FILES) and the importance matrix llama.cpp's IQ2_XXS / IQ3_XXS files
    are made with (kept if already there)."""
    from benchmarks.quality import IMATRIX_CHUNKS, make_imatrix
    from sluice.tools.inflate import demo_model_dir
    from sluice.tools.quantize import quantize as sluice_quantize

    for to in SLUICE_FILES:
        path = work / f"demo-{to}.gguf"
        if not path.exists():
            sluice_quantize(demo_model_dir(), path, to)
    if not (work / "demo.imatrix").exists():
        make_imatrix(demo_model_dir(), corpus, work / "demo.imatrix", 256, IMATRIX_CHUNKS)


def tensor_types(path: Path) -> dict[str, list[str]]:
    """The GGML types in the file's header: per expert projection (gate / up / down, each layer's) and for the other
    2-D weights (attention, embeddings, output); types in the order first met."""
    import gguf

    out: dict[str, list[str]] = {"gate": [], "up": [], "down": [], "other": []}
    for t in gguf.GGUFReader(path).tensors:
        m = re.search(r"\.ffn_(gate|up|down)_exps\.weight$", t.name)
        key = m.group(1) if m else "other" if len(t.shape) > 1 and t.tensor_type.name != "F32" else None
        if key and t.tensor_type.name not in out[key]:
            out[key].append(t.tensor_type.name)
    return out


def machine() -> dict:
    """The CPU (model name and the vector / matrix extensions the kernels may use) and the commit the run is at."""
    cpu, flags = platform.processor(), []
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = re.search(r"model name\s*:\s*(.*)", info).group(1)
        flags = sorted({f for f in re.search(r"flags\s*:\s*(.*)", info).group(1).split()
                        if f == "avx2" or f.startswith(("avx512", "amx"))})
    except (OSError, AttributeError):
        pass
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    return {"cpu": cpu, "flags": flags, "cpus": os.cpu_count(), "commit": commit + ("+changes" if dirty else "")}


def _made_by(name: str) -> str:
    if name in SLUICE_FILES:
        return f"`sluice quantize --to {name}`"
    return "llama.cpp, imatrix" if LLAMA_FILES[name] else "llama.cpp"


def markdown(results: dict) -> str:
    ctx, mach = results["context"], results["machine"]
    lines = [
        "# Perplexity: sluice vs llama.cpp on the same GGUF files",
        "",
        f"The demo model (sluice/assets/demo) on its held-out validation text ({results['text_chars']:,} characters, "
        f"14 Python-documentation files never trained on), llama.cpp's definition: non-overlapping windows of {ctx} "
        f"tokens, the second half of each scored. Command: `{COMMAND}` (llama-cpp-python {results['llama_cpp']}), "
        f"at {mach['commit']} on {mach['cpu']} ({mach['cpus']} CPUs; {', '.join(mach['flags'])}), one thread each "
        "side. `sluice quantize` wrote the files so marked; llama.cpp's `llama_model_quantize` (quality.py "
        "`quantize`) the others from the bf16 file, IQ3_XXS / IQ2_XXS with an importance matrix computed on the "
        "demo corpus' training split (quality.py `imatrix`). sluice bf16 is the default dtype: the integer kernels "
        "code the quantized projections' activations at 16 bits (`--activations int16`) or 8 (`int8`); the default "
        "(`auto`) codes at 8 when the experts average under 4 bits a weight (the starred column). llama.cpp codes "
        "activations at 8 bits (Q8_0 / Q8_K).",
        "",
        "| file | made by | size | sluice float32 | sluice bf16, int16 | sluice bf16, int8 | llama.cpp | "
        "sluice f32 / llama.cpp | sluice default / llama.cpp | tokens scored | same token ids |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results["files"].items():
        s32, ll = r["sluice_float32"], r["llama_cpp"]
        default = r[f"sluice_{r['default_activations']}"]
        star = {k: "*" if k == r["default_activations"] else "" for k in ("int16", "int8")}
        same = "yes" if s32["ids"] == ll["ids"] else f"no ({s32['n_ids']} vs {ll['n_ids']})"
        lines.append(f"| {name} | {_made_by(name)} | {r['bytes'] / 2**20:.1f} MiB | {s32['perplexity']:.4f} | "
                     f"{r['sluice_int16']['perplexity']:.4f}{star['int16']} | "
                     f"{r['sluice_int8']['perplexity']:.4f}{star['int8']} | {ll['perplexity']:.4f} | "
                     f"{s32['perplexity'] / ll['perplexity'] - 1:+.3%} | "
                     f"{default['perplexity'] / ll['perplexity'] - 1:+.3%} | {s32['tokens_scored']:,} | {same} |")
    lines += ["", "Types in each file (its header): expert gate / up / down; the other 2-D weights (attention, "
              "embeddings, output). Expert formats as sluice reads them, after the arrow.", ""]
    for name, r in results["files"].items():
        t = r["types"]
        lines.append(f"- {name}: experts {' / '.join(', '.join(t[k]) for k in ('gate', 'up', 'down'))}; other "
                     f"{', '.join(t['other'])} -> {', '.join(r['sluice_float32']['expert_formats'])}")
    im = results["imatrix"]
    lines += ["", f"The importance matrix: {im['chunks']} windows of {im['context']} tokens ({im['tokens']:,} tokens) of "
              f"{im['calibration']}, spread evenly over its {im['text_tokens']:,} tokens.",
              "",
              "tq1_0 and tq2_0 hold the same values (the `gguf` package's encoders round each weight to -1, 0 or 1 "
              "times its 256-block's largest magnitude; only the packing differs: their dequantized tensors are "
              "equal), hence equal rows. The ternary files are this model's weights rounded to three levels, not a "
              "model trained ternary (as BitNet-style models are): their perplexity says what that rounding costs. "
              "There sluice float32 (the file's exact dequantization) is 0.07% below llama.cpp, while sluice's "
              "bf16 runs are within 0.02% of it at either coding: on this far-from-trained model the rounding of "
              "the computation itself moves perplexity more than on the others, not the reading of the file."]
    return "\n".join(lines) + "\n"


def run(args, quality_py: Path) -> None:
    """The table (see the module docstring): sluice's files and the imatrix here, llama.cpp's files and perplexity in
    a peers-venv child beside sluice's perplexity (neither is timed)."""
    from benchmarks.quality import val_text
    from sluice.options import LoadOptions
    from sluice.plan import plan

    if not args.peer_python.is_file():
        raise SystemExit(f"quality.py perplexity: no {args.peer_python}: `bash benchmarks/peers/setup.sh` once "
                         "(llama-cpp-python in the peers venv), or pass --peer-python")
    text = val_text(args.corpus)  # one line when the corpus is absent, before any file is written
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "val.txt").write_text(text, "utf-8")
    make_files(args.work, args.corpus)
    child = subprocess.Popen([str(args.peer_python), str(quality_py), "perplexity", "--llama-cpp-child",
                              "--work", str(args.work), "--context", str(args.context), "--threads", str(args.threads)],
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    rows: dict[str, dict] = {}
    for name in FILES:
        path = args.work / f"demo-{name}.gguf"
        while not path.exists():  # llama.cpp's files: being written by the child
            if child.poll() is not None:
                raise SystemExit(f"the llama.cpp child exited ({child.returncode}) before writing {path}")
            time.sleep(2)
        row = rows[name] = {"bytes": path.stat().st_size, "types": tensor_types(path)}
        # which coding the default picks: its run is that column's
        row["default_activations"] = plan(path, LoadOptions.make(memory="all")).activations
        for key, dtype, coding in (("sluice_float32", "float32", "auto"), ("sluice_int16", "auto", "int16"),
                                   ("sluice_int8", "auto", "int8")):
            done = args.work / f"sluice-{name}-{dtype}-{coding}.json"
            if not done.exists():
                done.write_text(json.dumps(sluice_perplexity(path, text, args.context, dtype, args.threads, coding)))
            row[key] = json.loads(done.read_text())
            print(f"sluice {name} {dtype} {coding}: {row[key]['perplexity']:.4f}", file=sys.stderr)
    if child.wait() != 0:
        raise SystemExit(f"the llama.cpp child failed ({child.returncode})")
    results = {"context": args.context, "text_chars": len(text), "command": COMMAND, "machine": machine(),
               "imatrix": _imatrix_meta(args.work / "demo.imatrix"), "files": {}}
    for name in FILES:
        row = results["files"][name] = {**rows[name],
                                        "llama_cpp": json.loads((args.work / f"llamacpp-{name}.json").read_text())}
        results["llama_cpp"] = row["llama_cpp"]["version"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


def _imatrix_meta(path: Path) -> dict:
    from benchmarks import imatrix as imx

    return imx.read(path)[1]
