"""Token ids of sluice's GGUF tokenizer (`sluice.tokenizer_gguf`) against llama.cpp itself, per tokenizer file.

    bash benchmarks/peers/setup.sh            # once: llama-cpp-python built from source into benchmarks/peers/.venv
    PYTHONPATH=. .venv/bin/python benchmarks/tokenizer_llamacpp.py [--out benchmarks/results/tokenizer_llamacpp.md]

CI does not build llama.cpp, so this lives here; tests/test_tokenizer_gguf.py checks the same files against
tokenizer.json and transformers. The files (tests/tokenizer_cases.py): two tiny models written by `sluice
export-gguf` ("gpt-2" and "qwen2" pre-tokenizers), the gpt-2 vocabulary re-labelled with other llama.cpp
pre-tokenizer names, and a Mixtral-shaped SentencePiece ("llama") vocabulary. Each is tokenized on a few hundred
varied texts (unicode, digits, whitespace runs, special tokens inside text, emoji, CJK, combining marks, ...) by
sluice, by llama.cpp (`Llama(path, vocab_only=True).tokenize(text, add_bos=..., special=True)`, in the peers venv),
by transformers' GGUF tokenizer and by the matching tokenizer.json. Decoding is compared with `llama_detokenize`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import unicodedata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import transformers  # noqa: E402

from sluice.tokenizer import Tokenizer  # noqa: E402
from sluice.tokenizer_gguf import tokenizer_from_gguf  # noqa: E402
from tests import tokenizer_cases as tc  # noqa: E402

# Runs in the peers venv: llama.cpp's ids and detokenized text for every text of every file.
CHILD = r"""
import ctypes, json, sys
import llama_cpp

def detokenize(vocab, ids, unparse_special):
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64 + 16 * len(ids)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, unparse_special)
    return buf.raw[:n].decode("utf-8", "replace") if n >= 0 else None

jobs, out = json.load(open(sys.argv[1])), {}
for job in jobs:
    llm = llama_cpp.Llama(job["path"], vocab_only=True, verbose=False)
    vocab = llm._model.vocab
    res = out[job["name"]] = {"special": [], "plain": [], "decode": [], "decode_special": []}
    for text in job["texts"]:
        data = text.encode("utf-8")
        ids = llm.tokenize(data, add_bos=True, special=True)
        res["special"].append(ids)
        res["plain"].append(llm.tokenize(data, add_bos=False, special=True))
        res["decode"].append(detokenize(vocab, ids, False))
        res["decode_special"].append(detokenize(vocab, ids, True))
    del llm
json.dump({"version": llama_cpp.__version__, "files": out}, open(sys.argv[2], "w"))
"""


def cases(root: Path) -> list[dict]:
    """name, path, texts, and the references that exist for each file: text, add_special -> ids."""
    exported = tc.exported_bpe_files(root)
    bpe_texts = tc.texts((*tc.BPE_SPECIALS, "<think>", "</think>"))
    out = []
    for pre, (folder, path) in exported.items():
        ref = Tokenizer.from_folder(folder)
        out.append({"name": f"{pre} (export-gguf)", "path": path, "texts": bpe_texts,
                    "tokenizer.json": lambda t, a, ref=ref: ref.encode(t, a)})
    gpt2_folder, gpt2_path = exported["gpt-2"]
    for pre, (pre_tok, ignore_merges) in tc.reference_pre_tokenizers().items():
        if pre in exported:
            continue
        ref = tc.with_pre_tokenizer(gpt2_folder / "tokenizer.json", pre_tok, ignore_merges)
        out.append({"name": pre, "path": tc.pre_variant(gpt2_path, pre, root / f"{pre}.gguf"), "texts": bpe_texts,
                    "tokenizer.json": lambda t, a, ref=ref: ref.encode(t, add_special_tokens=a).ids})
    out.append({"name": "llama-bpe, no add_bos key",
                "path": tc.pre_variant(gpt2_path, "llama-bpe", root / "llama3-bos.gguf", add_bos_token=None),
                "texts": bpe_texts})
    kv, hf = tc.spm_vocab()
    out.append({"name": "llama (SentencePiece)", "path": tc.write_vocab_gguf(root / "spm.gguf", kv),
                "texts": tc.texts((*tc.SPM_CONTROL, *tc.SPM_USER_DEFINED)),
                "tokenizer.json": lambda t, a: hf.encode(t, add_special_tokens=a).ids})
    for case in out:
        path = case["path"]
        hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        case["transformers"] = lambda t, a, hf_tok=hf_tok: hf_tok.encode(t, add_special_tokens=a)
    return out


def run_llama_cpp(peer_python: str, jobs: list[dict], work: Path) -> dict:
    (work / "jobs.json").write_text(json.dumps(jobs))
    subprocess.run([peer_python, "-c", CHILD, str(work / "jobs.json"), str(work / "out.json")], check=True)
    return json.loads((work / "out.json").read_text())


def compare(case: dict, cpp: dict) -> tuple[dict, list[str]]:
    """Agreement counts for one file, and a few mismatch examples."""
    tok = tokenizer_from_gguf(tc.gguf_metadata(case["path"]), str(case["path"]))
    texts, counts, examples = case["texts"], {}, []

    def count(label: str, got, want) -> None:
        same = [g == w for g, w in zip(got, want)]
        counts[label] = sum(same)
        for text, g, w, ok in zip(texts, got, want, same):
            if not ok and len([e for e in examples if e.startswith(label)]) < 3:
                examples.append(f"{label}: {text[:60]!r}\n    sluice {g if isinstance(g, str) else g[:16]}\n"
                                f"    other  {w if isinstance(w, str) else w[:16]}")

    ours = [tok.encode(t) for t in texts]
    count("llama.cpp", ours, cpp["special"])
    count("llama.cpp, no add_special", [tok.encode(t, False) for t in texts], cpp["plain"])
    count("llama.cpp decode", [tok.decode(i) for i in cpp["special"]], cpp["decode"])
    count("llama.cpp decode special", [tok.decode(i, False) for i in cpp["special"]], cpp["decode_special"])
    for ref in ("transformers", "tokenizer.json"):
        if ref in case:
            want = [case[ref](t, True) for t in texts]
            count(ref, ours, want)
            counts[f"{ref} = llama.cpp"] = sum(w == c for w, c in zip(want, cpp["special"]))
    counts["NFC texts"] = sum(unicodedata.is_normalized("NFC", t) for t in texts)
    return counts, examples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peer-python", default="benchmarks/peers/.venv/bin/python")
    ap.add_argument("--out", help="also write the table (markdown) here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        all_cases = cases(work)
        jobs = [{"name": c["name"], "path": str(c["path"]), "texts": c["texts"]} for c in all_cases]
        cpp = run_llama_cpp(args.peer_python, jobs, work)
        lines = [f"llama-cpp-python {cpp['version']}, transformers {transformers.__version__}; "
                 "cells: texts on which sluice gives the same ids (decode: the same text) as the column's tool",
                 "", "| file | texts | llama.cpp | llama.cpp, no add_special | llama.cpp decode | "
                 "llama.cpp decode, specials shown | transformers | tokenizer.json | transformers = llama.cpp | "
                 "tokenizer.json = llama.cpp |", "|" + "---|" * 10]
        notes = []
        for case in all_cases:
            counts, examples = compare(case, cpp["files"][case["name"]])
            cell = lambda k: str(counts[k]) if k in counts else "-"  # noqa: E731
            lines.append(f"| {case['name']} | {len(case['texts'])} ({counts['NFC texts']} NFC) | "
                         + " | ".join(cell(k) for k in ("llama.cpp", "llama.cpp, no add_special", "llama.cpp decode",
                                                        "llama.cpp decode special", "transformers", "tokenizer.json",
                                                        "transformers = llama.cpp", "tokenizer.json = llama.cpp"))
                         + " |")
            notes += [f"[{case['name']}] {e}" for e in examples]
    text = "\n".join(lines + ["", "Mismatch examples (first 3 per column):", *notes]) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text, "utf-8")


if __name__ == "__main__":
    main()
