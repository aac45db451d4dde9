"""Prepare the demo model's training corpus: the English prose of Python's documentation, as plain text.

Source: the reStructuredText sources of the Python 3.11 documentation as Debian ships them in the `python3.11-doc`
package (`/usr/share/doc/python3.11/html/_sources/**/*.rst.txt`; `apt-get install python3.11-doc`). Licence: the
Python Software Foundation License Version 2 (the documentation's own licence, see `copyright.rst.txt` and
`license.rst.txt` there; its code examples are also under the Zero-Clause BSD licence). Free to use, modify and
redistribute, so a model trained on it can ship in the package.

Why this corpus: it is offline here, clearly licensed, ~8 MB of mostly expository English ("Return a new list
containing ..."), and regular enough that a ~15M-parameter model trained for under an hour on one CPU core writes
recognisable sentences. Debian's `fortunes` was the other candidate; its quotations carry their authors' copyrights
(only the program is BSD), and its short, unrelated quips are harder for a tiny model to imitate.

What is kept: paragraphs of prose, list items and section titles, with reST markup reduced to its text
(`:func:`len`` -> `len`, ``` ``x`` ``` -> `x`, `*x*` -> `x`). What is dropped: literal and code blocks, doctests,
tables, directives whose body is not prose (toctree, code-block, index, ...), field lists, and lines that are mostly
punctuation or digits. Each source file becomes one document (its paragraphs joined by blank lines).

Split: whole files, by a hash of their path: `crc32(path) % 20 == 0` goes to validation (~5%), the rest to training.
Deterministic: the same source tree gives byte-identical output (files are visited in sorted order).

Usage:  python scripts/demo_corpus.py [--src DIR] [--out build/demo/corpus]
Writes OUT/train.jsonl, OUT/val.jsonl (one {"source", "text"} object per document) and OUT/meta.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import zlib
from pathlib import Path

DEFAULT_SRC = Path("/usr/share/doc/python3.11/html/_sources")
DEFAULT_OUT = Path("build/demo/corpus")
VAL_MODULUS = 20  # 1 file in 20 -> validation

# Folders of the documentation that hold prose; c-api, extending, distutils and whatsnew are mostly C, build recipes
# and changelogs, which a tiny model would only half learn and which read poorly as demo text.
SECTIONS = ("tutorial", "library", "howto", "faq", "reference", "using", "glossary.rst.txt")

# Directives whose indented body is prose (kept, dedented); every other directive's body is dropped.
PROSE_DIRECTIVES = {
    "note", "warning", "seealso", "important", "tip", "attention", "caution", "hint", "danger", "admonition",
    "function", "method", "class", "attribute", "data", "exception", "describe", "decorator", "decoratormethod",
    "classmethod", "staticmethod", "abstractmethod", "coroutinefunction", "coroutinemethod", "opcode", "envvar",
    "option", "cmdoption", "impl-detail", "glossary", "topic", "sidebar", "deprecated", "versionadded",
    "versionchanged", "deprecated-removed", "availability", "rubric", "pdbcommand", "monitoring-event",
}
_DIRECTIVE = re.compile(r"\.\.\s+([\w:-]+)::")
_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+<>_.:])\1{2,}\s*$")
_BULLET = re.compile(r"^(?:[*+-]|#\.|\d+\.|[a-z]\.|\(\d+\))\s+")
_FIELD = re.compile(r"^:[\w -]+:(\s|$)")

_ROLE = re.compile(r":[\w:+.-]+:`([^`]*)`")
_LITERAL = re.compile(r"``(.+?)``")
_LINK = re.compile(r"`([^`<]*?)\s*<[^`>]*>`_{0,2}")
_INTERPRETED = re.compile(r"`([^`]+)`_{0,2}")
_STRONG = re.compile(r"\*\*([^*]+)\*\*")
_EMPH = re.compile(r"(?<![\w*])\*([^*\s][^*]*?)\*(?![\w*])")
_FOOTNOTE = re.compile(r"\s*\[(?:#\w*|\d+|\*)\]_")
_SUBST = re.compile(r"\|[\w -]+\|_?")


def _role_text(m: re.Match) -> str:
    inner = m.group(1)
    if inner.endswith(">") and "<" in inner:  # :ref:`title <target>`
        return inner[: inner.index("<")].strip()
    inner = inner.lstrip("!")
    if inner.startswith("~"):  # :func:`~os.path.join` shows as join
        inner = inner[1:].rsplit(".", 1)[-1]
    return inner


def inline_text(s: str) -> str:
    """reST inline markup -> its text."""
    s = _ROLE.sub(_role_text, s)
    s = _LITERAL.sub(r"\1", s)
    s = _LINK.sub(r"\1", s)
    s = _INTERPRETED.sub(r"\1", s)
    s = _STRONG.sub(r"\1", s)
    s = _EMPH.sub(r"\1", s)
    s = _FOOTNOTE.sub("", s)
    s = _SUBST.sub("", s)
    s = s.replace("\\ ", "").replace("\\", "")
    return re.sub(r"\s+", " ", s).strip()


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def prose_blocks(rst: str) -> list[list[str]]:
    """Split a reST file into blocks of raw prose lines, dropping code, doctests, tables and non-prose directives."""
    blocks: list[list[str]] = [[]]
    skip_deeper_than: int | None = None  # drop lines indented more than this (literal blocks, directive bodies)
    skip_to_blank = False  # drop up to the next blank line (directive signatures and options, doctests)

    def new_block() -> None:
        if blocks[-1]:
            blocks.append([])

    for line in rst.expandtabs(8).splitlines():
        stripped = line.strip()
        indent = _indent(line)
        if skip_to_blank:
            if stripped:
                continue
            skip_to_blank = False
        if skip_deeper_than is not None:
            if not stripped or indent > skip_deeper_than:
                continue
            skip_deeper_than = None
        if not stripped:
            new_block()
            continue
        if stripped.startswith(".."):
            new_block()
            m = _DIRECTIVE.match(stripped)
            if m and m.group(1).split(":")[-1] in PROSE_DIRECTIVES:
                skip_to_blank = True  # the signature lines and :options:; the body after the blank line stays
            else:  # a comment, a target, or a directive whose body is code, a table or a toctree
                skip_deeper_than = indent
            continue
        if _UNDERLINE.match(stripped) or stripped.startswith(("+-", "+=", "|", ">>>", "...")) or _FIELD.match(stripped):
            new_block()
            if stripped.startswith((">>>", "...")):
                skip_to_blank = True
            continue
        if _BULLET.match(stripped):
            new_block()
            stripped = _BULLET.sub("", stripped)
        if stripped.endswith("::"):  # an expanded literal block follows, indented
            text = stripped[:-2].rstrip()
            if text:
                blocks[-1].append(text + ":")
            new_block()
            skip_deeper_than = indent
            continue
        blocks[-1].append(stripped)
    return [b for b in blocks if b]


def is_prose(text: str) -> bool:
    """A paragraph worth training on: several words, mostly letters."""
    if len(text) < 30 or len(text.split()) < 5:
        return False
    letters = sum(c.isalpha() or c == " " for c in text)
    return letters >= 0.8 * len(text)


def document(rst: str) -> str:
    paragraphs = [inline_text(" ".join(block)) for block in prose_blocks(rst)]
    return "\n\n".join(p for p in paragraphs if is_prose(p))


def source_files(src: Path) -> list[Path]:
    files: list[Path] = []
    for section in SECTIONS:
        path = src / section
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files.extend(sorted(path.rglob("*.rst.txt")))
    return files


def is_validation(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % VAL_MODULUS == 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", type=Path, default=DEFAULT_SRC, help=f"reST sources (default {DEFAULT_SRC})")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    if not args.src.is_dir():
        print(f"error: {args.src} not found; install Debian's python3.11-doc (apt-get install python3.11-doc) "
              "or pass --src", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[dict]] = {"train": [], "val": []}
    for path in source_files(args.src):
        rel = path.relative_to(args.src).as_posix()
        text = document(path.read_text(encoding="utf-8"))
        if text:
            splits["val" if is_validation(rel) else "train"].append({"source": rel, "text": text})
    meta: dict = {"src": str(args.src), "licence": "PSF-2.0 (Python documentation)", "val_modulus": VAL_MODULUS}
    for name, docs in splits.items():
        path = args.out / f"{name}.jsonl"
        data = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
        path.write_bytes(data)
        meta[name] = {"documents": len(docs), "chars": sum(len(d["text"]) for d in docs),
                      "sha256": hashlib.sha256(data).hexdigest()}
        print(f"{name}: {len(docs)} documents, {meta[name]['chars']:,} characters -> {path}")
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
