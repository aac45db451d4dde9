"""Child of test_changed_files.py: load a model, change its weight file between generation steps, report.

Run as `python changed_file_child.py MODEL_DIR WORK_DIR SCENARIO...`, a scenario being
`IO:ODIRECT:EMBEDDINGS:HOW-WHEN-STORE` (e.g. `direct:1:resident:truncate-between-stream`). For each it copies the
model to a fresh folder, loads it, runs a step (or not), changes the file, generates, and prints one JSON line:
{"scenario", "error", "file", "type", "weights"} or {"scenario", "ok": true, "weights", "warnings"}. A SIGBUS kills the process,
which the parent sees as a negative return code: that is the point of running here and not inside pytest. One
child runs many scenarios because importing torch costs seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import sluice
import sluice.io.base
from sluice.errors import SluiceError

sluice.io.base.PATH_CHECK_S = 0.0  # look the paths up at every batch: what a warning says must not hang on timing

IDS = [5, 17, 42, 99, 3, 250, 77, 8]


def change(path: Path, how: str) -> None:
    size = path.stat().st_size
    if how == "truncate":
        os.truncate(path, size // 2)
    elif how == "truncate-tail":
        os.truncate(path, size - 1)
    elif how == "rewrite":  # same size, same header, other data: only the modification time tells
        data = bytearray(path.read_bytes())
        data[size // 2 :] = bytes(size - size // 2)
        with open(path, "r+b") as f:
            f.seek(0)
            f.write(data)
    elif how == "replace":  # a new file at the same path, as a re-download by rename does
        tmp = path.with_name(path.name + ".new")
        data = bytearray(path.read_bytes())
        data[size // 2 :] = bytes(size - size // 2)
        tmp.write_bytes(data)
        os.replace(tmp, path)
    else:
        raise ValueError(how)


def run(model: Path, work: Path, scenario: str) -> dict:
    """scenario: 'io:odirect:embeddings:<how>-<when>-<store>', when in {before, between}, store in {stream,
    resident}."""
    io, odirect, embeddings, case = scenario.split(":")
    how, when, store = case.rsplit("-", 2)
    folder = work / scenario.replace(":", "_")
    shutil.copytree(model, folder)
    memory = None
    if store == "stream":
        with sluice.load(folder, memory=None) as m:  # the smallest streaming budget: top_k expert slots
            memory = m.resident_bytes + m.spec.top_k * m.layout.expert_nbytes
    with sluice.load(folder, memory=memory, io=io, odirect=odirect == "1", embeddings=embeddings) as m:
        weights = m.index.files[0]
        if when == "between":
            m.logits(IDS[:4])
        change(weights, how)
        try:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                list(m.generate_tokens(IDS, max_tokens=4, stop_at_eos=False))
        except SluiceError as e:
            return {"scenario": scenario, "error": str(e), "file": getattr(e, "file", None),
                    "type": type(e).__name__, "weights": str(weights)}
    return {"scenario": scenario, "ok": True, "weights": str(weights), "warnings": [str(w.message) for w in said]}


def main() -> None:
    model, work, *scenarios = sys.argv[1:]
    for scenario in scenarios:
        print(json.dumps(run(Path(model), Path(work), scenario)), flush=True)


if __name__ == "__main__":
    main()
