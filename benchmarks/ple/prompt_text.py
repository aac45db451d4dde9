"""Real text for the PLE benchmark's prompts (issue 31 asks for real text: its n-grams repeat as a user's do, which
the per-pass deduplication of rows depends on; seeded random ids would make every n-gram distinct).

    .venv/bin/python benchmarks/ple/prompt_text.py MODEL_FOLDER N OUT.txt

The text: every Markdown file tracked in this repository, sorted by path and concatenated (English prose, tables and
commands; ~316 KB at the commit that added this script), cut to its first N tokens under the model's own tokenizer
(MODEL_FOLDER/tokenizer.json) and decoded back to text. The bench encodes it again with the GGUF's tokenizer, so the
prompt's length there can differ by a few tokens; the bench's results.json holds the ids every arm replayed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[2]


def corpus() -> str:
    files = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    return "\n\n".join((ROOT / f).read_text("utf-8") for f in sorted(files.stdout.split()))


def main() -> None:
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    folder, n, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tok.encode(corpus(), add_special_tokens=False).ids
    if len(ids) < n:
        raise SystemExit(f"error: the corpus is {len(ids)} tokens under this tokenizer, fewer than {n}")
    text = tok.decode(ids[:n])
    out.write_text(text, "utf-8")
    print(f"{out}: {n} tokens, {len(text)} characters")


if __name__ == "__main__":
    main()
