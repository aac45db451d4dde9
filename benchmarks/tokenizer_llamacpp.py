"""Token ids of sluice's GGUF tokenizer (`sluice.tokenizer.gguf`) against llama.cpp itself, per tokenizer file.

    bash benchmarks/peers/setup.sh            # once: llama-cpp-python built from source into benchmarks/peers/.venv
    PYTHONPATH=. .venv/bin/python benchmarks/tokenizer_llamacpp.py [--out benchmarks/results/tokenizer_llamacpp.md]

CI does not build llama.cpp, so this lives here; tests/test_tokenizer_gguf.py checks the made files against
tokenizer.json and transformers. Two kinds of files:
- made here (tests/tokenizer_cases.py): two tiny models written by `sluice export-gguf` ("gpt-2" and "qwen2"
  pre-tokenizers), the gpt-2 vocabulary relabelled with other llama.cpp pre-tokenizer names, and a Mixtral-shaped
  SentencePiece ("llama") vocabulary;
- the real vocabularies llama.cpp tests itself with (models/ggml-vocab-*.gguf of the llama.cpp that
  llama-cpp-python vendors: Qwen2, Llama 3, Llama 2 SentencePiece, GPT-2, MPT, StarCoder, ...), fetched once with
  `pip download` of the llama-cpp-python source package into benchmarks/models/llama-cpp-vocab (git-ignored).
Each is tokenized on a few hundred varied texts (unicode, digits, whitespace runs, special tokens inside text,
emoji, CJK, combining marks, ...; for the real files llama.cpp's own test texts too) by sluice, by llama.cpp
(`Llama(path, vocab_only=True).tokenize(text, add_bos=..., special=True)`, in the peers venv), by transformers' GGUF
tokenizer and by the matching tokenizer.json where one exists. Decoding is compared with `llama_detokenize`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
import unicodedata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import transformers  # noqa: E402

from sluice.errors import SluiceError  # noqa: E402
from sluice.tokenizer import Tokenizer  # noqa: E402
from sluice.tokenizer.gguf import tokenizer_from_gguf  # noqa: E402
from tests import tokenizer_cases as tc  # noqa: E402

# Runs in the peers venv: llama.cpp's ids and detokenized text for every text of every file.
CHILD = r"""
import ctypes, json, sys
import llama_cpp

def detokenize(vocab, ids, unparse_special):
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64 + 64 * len(ids)
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

# pre-tokenizers for which llama.cpp leaves clean_spaces off (llama-vocab.cpp); SentencePiece has it off too
NO_CLEAN_SPACES = {"qwen2", "qwen35", "deepseek-r1-qwen", "command-r", "smollm", None}


def clean_spaces(text: str) -> str:
    """llama_detokenize's clean-up of decoded text (its three passes: " ?" " !" " ." " ," lose the space, " ' "
    becomes "'", " 's" " 'm" " 're" " 've" lose the space), to show it is the only decoding difference."""
    out: list[str] = []
    for i, x in enumerate(text):  # pass 1
        if i and text[i - 1] == " " and x in "?!.,":
            out.pop()
        out.append(x)
    src, out, i = out, [], 0
    while i < len(src):  # pass 2
        x = src[i]
        if i and x == "'" and i + 1 < len(src) and src[i - 1] == " " and src[i + 1] == " ":
            out.pop()
            src[i + 1] = "\0"
            out.append(x)
            i += 2
            continue
        out.append(x)
        i += 1
    src, out = [c for c in out], []
    for i, x in enumerate(src):  # pass 3
        if i and src[i - 1] == " " and x == "'" and i + 1 < len(src):
            nxt = src[i + 1:i + 3]
            if nxt[0] in "sm" or (len(nxt) == 2 and "".join(nxt) in ("re", "ve")):
                out.pop()
        out.append(x)
    return "".join(out)


def made_cases(root: Path) -> list[dict]:
    """The files made here: name, path, texts, and the tokenizer.json reference where one exists."""
    exported = tc.exported_bpe_files(root)
    bpe_texts = tc.texts((*tc.BPE_SPECIALS, "<think>", "</think>"))
    out = []
    for pre, (folder, path) in exported.items():
        ref = Tokenizer.from_folder(folder)
        out.append({"name": f"{pre} (export-gguf)", "path": path, "texts": bpe_texts, "pre": pre,
                    "tokenizer.json": lambda t, a, ref=ref: ref.encode(t, a)})
    gpt2_folder, gpt2_path = exported["gpt-2"]
    for pre, (pre_tok, ignore_merges) in tc.reference_pre_tokenizers().items():
        if pre in exported:
            continue
        ref = tc.with_pre_tokenizer(gpt2_folder / "tokenizer.json", pre_tok, ignore_merges)
        out.append({"name": pre, "path": tc.pre_variant(gpt2_path, pre, root / f"{pre}.gguf"), "texts": bpe_texts,
                    "pre": pre, "tokenizer.json": lambda t, a, ref=ref: ref.encode(t, add_special_tokens=a).ids})
    out.append({"name": "llama-bpe, no add_bos key", "pre": "llama-bpe", "texts": bpe_texts,
                "path": tc.pre_variant(gpt2_path, "llama-bpe", root / "llama3-bos.gguf", add_bos_token=None)})
    kv, hf = tc.spm_vocab()
    out.append({"name": "llama (SentencePiece)", "path": tc.write_vocab_gguf(root / "spm.gguf", kv), "pre": None,
                "texts": tc.texts((*tc.SPM_CONTROL, *tc.SPM_USER_DEFINED)),
                "tokenizer.json": lambda t, a: hf.encode(t, add_special_tokens=a).ids})
    return out


def fetch_vocabs(peer_python: str, dest: Path) -> None:
    """llama.cpp's test vocabularies from the source package of the llama-cpp-python the peers venv runs."""
    version = subprocess.run([peer_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"], check=True,
                             capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([peer_python, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", tmp], check=True)
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))) as tar:
            for member in tar.getmembers():
                if "/vendor/llama.cpp/models/ggml-vocab-" in member.name and member.isfile():
                    (dest / Path(member.name).name).write_bytes(tar.extractfile(member).read())


def real_cases(vocab_dir: Path) -> tuple[list[dict], list[str]]:
    """llama.cpp's test vocabularies sluice reads, and a line for each it refuses."""
    out, refused = [], []
    for path in sorted(vocab_dir.glob("ggml-vocab-*.gguf")):
        md = tc.gguf_metadata(path)
        try:
            tok = tokenizer_from_gguf(md, str(path))
        except SluiceError as e:
            refused.append(f"{path.name}: {e}")
            continue
        specials = [t for t, kind in zip(tok.vocab.tokens, tok.vocab.types) if kind in (2, 3, 4)]  # unk/control/user
        specials = specials[:6] + specials[-6:] + [t for t in (tok.bos_token, tok.eos_token) if t]
        inp = path.with_name(path.name + ".inp")
        own = inp.read_text("utf-8").split("\n__ggml_vocab_test__\n") if inp.exists() else []
        out.append({"name": path.name, "path": path, "pre": tok.vocab.pre, "texts": own + tc.texts(specials),
                    "tokenizer": tok})
    return out, refused


def run_llama_cpp(peer_python: str, jobs: list[dict], work: Path) -> dict:
    (work / "jobs.json").write_text(json.dumps(jobs))
    subprocess.run([peer_python, "-c", CHILD, str(work / "jobs.json"), str(work / "out.json")], check=True)
    return json.loads((work / "out.json").read_text())


NOTES = """Reading the table:
- tokenizer.json misses only texts that NFC normalization changes (the "NFC" count): the trained tokenizers
  normalize to NFC, llama.cpp does not normalize, and neither does sluice's GGUF tokenizer.
- decode: llama_detokenize runs a clean-up pass (" ?" -> "?", " 's" -> "'s", ...) for the gpt-2 family of
  pre-tokenizers; sluice's decode, like llama-server's streamed pieces, does not. With that pass applied to
  sluice's text, every text agrees.
- transformers' GGUF tokenizer departs from llama.cpp where it ignores llama.cpp's rules: "default" (files with no
  pre-tokenizer, e.g. aquila) and "starcoder" split with the GPT-2 regex only; llama-bpe files without an
  add_bos key get no bos; SentencePiece gets no prefix space after special tokens nor before leading whitespace;
  Qwen2's vocabulary holds "</s>" as a NORMAL token that llama.cpp promotes to CONTROL (an end-of-generation text);
  Phi-3's specials swallow the whitespace after them in llama.cpp only.
"""

COLUMNS = ("llama.cpp", "llama.cpp, no add_special", "llama.cpp decode", "llama.cpp decode, its clean-up applied",
           "transformers", "tokenizer.json", "transformers = llama.cpp", "tokenizer.json = llama.cpp")


def compare(case: dict, cpp: dict) -> tuple[dict, list[str]]:
    """Agreement counts for one file, and a few mismatch examples."""
    path = case["path"]
    tok = case.get("tokenizer") or tokenizer_from_gguf(tc.gguf_metadata(path), str(path))
    texts, counts, examples = case["texts"], {}, []

    def count(label: str, got: list, want: list) -> None:
        same = [g == w for g, w in zip(got, want)]
        counts[label] = sum(same)
        for text, g, w, ok in zip(texts, got, want, same):
            if not ok and sum(e.startswith(label + ":") for e in examples) < 3:
                examples.append(f"{label}: {text[:60]!r}\n    sluice {g[:100] if isinstance(g, str) else g[:16]!r}\n"
                                f"    other  {w[:100] if isinstance(w, str) else w[:16]!r}")

    ours = [tok.encode(t) for t in texts]
    count("llama.cpp", ours, cpp["special"])
    count("llama.cpp, no add_special", [tok.encode(t, False) for t in texts], cpp["plain"])
    decoded = [tok.decode(i) for i in cpp["special"]]
    count("llama.cpp decode", decoded, cpp["decode"])
    if case["pre"] not in NO_CLEAN_SPACES:
        count("llama.cpp decode, its clean-up applied", [clean_spaces(d) for d in decoded], cpp["decode"])
    references = {}
    try:
        hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        references["transformers"] = lambda t, a: hf.encode(t, add_special_tokens=a)
    except Exception as e:  # an architecture transformers does not load from GGUF
        examples.append(f"transformers: cannot load it: {str(e)[:120]}")
    if "tokenizer.json" in case:
        references["tokenizer.json"] = case["tokenizer.json"]
    for label, ref in references.items():
        want = [ref(t, True) for t in texts]
        count(label, ours, want)
        counts[f"{label} = llama.cpp"] = sum(w == c for w, c in zip(want, cpp["special"]))
    counts["NFC"] = sum(unicodedata.is_normalized("NFC", t) for t in texts)
    return counts, examples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peer-python", default="benchmarks/peers/.venv/bin/python")
    ap.add_argument("--vocab-dir", type=Path, default=Path("benchmarks/models/llama-cpp-vocab"),
                    help="llama.cpp's ggml-vocab-*.gguf files; fetched with pip download when missing")
    ap.add_argument("--only", help="run only the files whose name contains this")
    ap.add_argument("--out", help="also write the table (markdown) here")
    args = ap.parse_args()
    if not list(args.vocab_dir.glob("ggml-vocab-*.gguf")):
        fetch_vocabs(args.peer_python, args.vocab_dir)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        real, refused = real_cases(args.vocab_dir)
        cases = [c for c in made_cases(work) + real if args.only is None or args.only in c["name"]]
        jobs = [{"name": c["name"], "path": str(c["path"]), "texts": c["texts"]} for c in cases]
        cpp = run_llama_cpp(args.peer_python, jobs, work)
        lines = [f"llama-cpp-python {cpp['version']}, transformers {transformers.__version__}. A cell counts the texts "
                 "on which sluice gives the same ids (decode: the same text) as that tool; the last two columns "
                 "count the texts on which the reference itself gives llama.cpp's ids.", "",
                 "| file | texts (NFC) | " + " | ".join(COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 2)]
        notes = []
        for case in cases:
            counts, examples = compare(case, cpp["files"][case["name"]])
            lines.append(f"| {case['name']} | {len(case['texts'])} ({counts['NFC']}) | "
                         + " | ".join(str(counts.get(k, "-")) for k in COLUMNS) + " |")
            notes += [f"[{case['name']}] {e}" for e in examples]
    text = "\n".join(lines + ["", NOTES, "Refused (ConfigError/CheckpointError):", *[f"- {r}" for r in refused], "",
                              "Mismatch examples (first 3 per column):", "```", *notes, "```"]) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text, "utf-8")


if __name__ == "__main__":
    main()
