"""Set a GGUF's trained context length (`<arch>.context_length`) in place, and its folder's config.json
`max_position_embeddings` beside it: `make-model` writes 4096 for every architecture, which caps sluice's KV cache
(plan.py: max_context <= the model's) below issue 31's 16,384-token prompt. Only that one integer changes (the
same 4 bytes rewritten; the tensors and every other field keep their bytes).

    .venv/bin/python benchmarks/ple/set_context.py MODEL.gguf 32768
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("context", type=int)
    a = ap.parse_args()
    if not 0 < a.context < 2**32:
        ap.error(f"context {a.context}: a GGUF stores it as a uint32 above 0")
    try:
        reader = gguf.GGUFReader(a.gguf, "r+")
    except (OSError, ValueError) as e:  # missing, unwritable, or not a GGUF (the reader's "GGUF magic invalid")
        raise SystemExit(f"{a.gguf}: cannot open it as a GGUF to rewrite: {e}") from None
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    field = reader.fields.get(f"{arch}.context_length")
    if field is None:
        raise SystemExit(f"{a.gguf}: no {arch}.context_length field to set")
    old = int(field.parts[-1][0])
    field.parts[-1][0] = a.context  # a memmap of the file opened r+: written in place
    reader.data.flush()
    config = a.gguf.parent / "config.json"
    if config.is_file():
        c = json.loads(config.read_text())
        (c.get("text_config") or c)["max_position_embeddings"] = a.context
        config.write_text(json.dumps(c, indent=2) + "\n")
    print(f"{a.gguf}: {arch}.context_length {old} -> {a.context}" + (f"; {config} too" if config.is_file() else ""))


if __name__ == "__main__":
    main()
