"""Every JSON file the checkpoint layer reads ends a hostile input in a CheckpointError naming the file.

config.json, generation_config.json, model.safetensors.index.json and tokenizer_config.json all go through
sluice.checkpoint.jsonfile: Python's json would raise RecursionError (deep nesting) or ValueError (an integer over
4300 digits), or accept lone surrogates that break whatever encodes the string later.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from sluice.checkpoint import write_safetensors
from sluice.checkpoint.jsonfile import MAX_DEPTH, loads, read_json
from sluice.errors import CheckpointError
from sluice.tokenizer import Tokenizer
from sluice.plan import open_index

HOSTILE = {
    "deep": b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # RecursionError in json.loads
    "deep-65": b'{"a": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}",  # parses, but deeper than anything real
    "huge-int": b'{"a": ' + b"7" * 5000 + b"}",  # ValueError: exceeds the 4300-digit limit
    "not-utf8": b'{"a": "\xff\xfe"}',
    "surrogate": b'{"a": "x\\ud800y"}',
    "surrogate-key": b'{"\\udfff": 1}',
    "truncated": b'{"a": [1, 2',
    "not-object": b"[1, 2, 3]",
}
WORDS = {
    "deep": "nested more than", "deep-65": "nested more than", "huge-int": "number too long",
    "not-utf8": "not valid UTF-8", "surrogate": "surrogate", "surrogate-key": "surrogate",
    "truncated": "not valid JSON", "not-object": "expected a JSON object",
}


def folder_with_weights(tmp_path: Path) -> Path:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "toy"}))
    write_safetensors(folder / "model.safetensors", {"w": torch.ones(2)})
    return folder


@pytest.mark.parametrize("kind", list(HOSTILE))
@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_config_files(tmp_path: Path, name: str, kind: str) -> None:
    folder = folder_with_weights(tmp_path)
    (folder / name).write_bytes(HOSTILE[kind])
    with pytest.raises(CheckpointError, match=WORDS[kind]) as info:
        open_index(folder)
    assert info.value.file == str(folder / name)


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_shard_index(tmp_path: Path, kind: str) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors.index.json").write_bytes(HOSTILE[kind])
    with pytest.raises(CheckpointError, match=WORDS[kind]) as info:
        open_index(folder)
    assert info.value.file == str(folder / "model.safetensors.index.json")


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_tokenizer_config(tmp_path: Path, kind: str) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel

    Backend(WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_bytes(HOSTILE[kind])
    with pytest.raises(CheckpointError, match=WORDS[kind]) as info:
        Tokenizer.from_folder(tmp_path)
    assert info.value.file == str(tmp_path / "tokenizer_config.json")


def test_big_side_file_is_refused_before_reading_it_whole(tmp_path: Path, monkeypatch) -> None:
    import sluice.checkpoint.jsonfile as jf

    monkeypatch.setattr(jf, "MAX_FILE_BYTES", 1000)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"a": "x" * 2000}))
    with pytest.raises(CheckpointError, match="larger than 1000 bytes"):
        read_json(path)


def test_fifo_config_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="not a regular file"):
        read_json(tmp_path / "config.json")


def test_valid_json_round_trips() -> None:
    value = {"a": [1, -2, 3.5, {"b": None, "c": True}], "emoji": "\U0001f600", "pair": "\ud83d\ude00".encode(
        "utf-16", "surrogatepass").decode("utf-16")}
    assert loads(json.dumps(value).encode(), "x.json") == value
    assert loads(b'{"s": "\\ud83d\\ude00"}', "x.json") == {"s": "\U0001f600"}  # an escaped pair is one code point
    assert loads(b'{"z": -0}', "x.json") == {"z": 0}  # only the safetensors header (reference=True) refuses -0
