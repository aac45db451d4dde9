"""CheckpointIndex over single-file and sharded folders; write_sharded streaming; errors that say what to do."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sluice.checkpoint import CheckpointIndex, write_safetensors, write_sharded
from sluice.errors import CheckpointError
from sluice.plan import open_index

CONFIG = {"model_type": "toy", "hidden_size": 8}


def make_tensors(n: int = 10, numel: int = 25) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = {f"layers.{i}.w": torch.randn(numel, generator=g) for i in range(n)}
    out["embed.weight"] = torch.randn(3, 4, generator=g).bfloat16()
    return out


def with_config(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder


def assert_refs_match(index: CheckpointIndex, tensors: dict[str, torch.Tensor]) -> None:
    assert set(index.names()) == set(tensors)
    for name, t in tensors.items():
        ref = index[name]
        with open(ref.path, "rb") as f:
            f.seek(ref.offset)
            got = f.read(ref.nbytes)
        assert got == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), name


# --- opening folders -----------------------------------------------------------------------------------------


def test_single_file_folder(tmp_path: Path) -> None:
    folder = with_config(tmp_path / "m")
    (folder / "generation_config.json").write_text('{"eos_token_id": 2}')
    tensors = make_tensors()
    save_file(tensors, str(folder / "model.safetensors"))
    index = open_index(folder)
    assert index.config == CONFIG and index.generation_config == {"eos_token_id": 2}
    assert index.files == [folder / "model.safetensors"] and index.folder == folder
    assert "layers.3.w" in index and "nope" not in index and len(index) == len(tensors)
    assert index.total_bytes() == sum(t.numel() * t.element_size() for t in tensors.values())
    assert_refs_match(index, tensors)


def test_generation_config_optional(tmp_path: Path) -> None:
    folder = with_config(tmp_path / "m")
    write_safetensors(folder / "model.safetensors", {"w": torch.ones(2)})
    assert open_index(folder).generation_config is None


def test_missing_tensor_suggests_close_names(tmp_path: Path) -> None:
    folder = with_config(tmp_path / "m")
    write_safetensors(folder / "model.safetensors", make_tensors())
    index = open_index(folder)
    with pytest.raises(CheckpointError) as info:
        index["layers.3.v"]
    msg = str(info.value)
    assert info.value.tensor == "layers.3.v" and str(folder) in msg and "'layers.3.w'" in msg


# --- write_sharded -------------------------------------------------------------------------------------------


def test_write_sharded_streams_and_opens(tmp_path: Path) -> None:
    tensors = make_tensors(n=10, numel=25)  # 100 bytes each
    produced: list[str] = []

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in tensors.items():
            produced.append(name)
            yield name, t

    folder = with_config(tmp_path / "m")
    files = write_sharded(folder, gen(), max_shard_bytes=250, progress=True)
    assert [p.name for p in files] == [f"model-{i:05d}-of-00005.safetensors" for i in range(1, 6)]
    assert produced == list(tensors)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [p.name for p in files] + ["config.json", "model.safetensors.index.json"]
    )
    index_json = json.loads((folder / "model.safetensors.index.json").read_text())
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert index_json["metadata"]["total_size"] == total
    assert index_json["weight_map"]["layers.0.w"] == files[0].name
    assert index_json["weight_map"]["embed.weight"] == files[-1].name

    index = open_index(folder)
    assert index.files == files and index.total_bytes() == total
    assert_refs_match(index, tensors)
    for shard in files:  # each shard is a valid file for the reference reader too
        assert all(index[name].path == str(shard) for name in load_file(str(shard)))


def test_write_sharded_single_file_and_stale_cleanup(tmp_path: Path) -> None:
    folder = with_config(tmp_path / "m")
    tensors = make_tensors()
    write_sharded(folder, tensors.items(), max_shard_bytes=300)
    files = write_sharded(folder, tensors.items(), max_shard_bytes=10_000)
    assert files == [folder / "model.safetensors"]
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert_refs_match(open_index(folder), tensors)


def test_write_sharded_oversized_tensor_gets_own_shard(tmp_path: Path) -> None:
    folder = with_config(tmp_path / "m")
    tensors = {"small": torch.ones(2), "big": torch.ones(100), "tail": torch.ones(2)}
    files = write_sharded(folder, tensors.items(), max_shard_bytes=64)
    assert [list(load_file(str(p))) for p in files] == [["small"], ["big"], ["tail"]]


def test_write_sharded_cleans_up_on_error(tmp_path: Path) -> None:
    folder = tmp_path / "m"

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(5):
            yield f"t{i}", torch.ones(16)
        raise RuntimeError("producer failed")

    with pytest.raises(RuntimeError, match="producer failed"):
        write_sharded(folder, gen(), max_shard_bytes=64)
    assert list(folder.iterdir()) == []


def test_transformers_interop(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    # transformers writes shards -> we index them
    theirs = tmp_path / "theirs"
    model.save_pretrained(theirs, max_shard_size="4KB")
    index = open_index(theirs)
    assert len(index.files) > 1 and index.config["model_type"] == "llama"
    assert index.generation_config is not None
    assert_refs_match(index, state)

    # we write shards -> transformers loads them
    ours = tmp_path / "ours"
    cfg.save_pretrained(ours)
    write_sharded(ours, state.items(), max_shard_bytes=4096)
    loaded = transformers.LlamaForCausalLM.from_pretrained(ours)
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, state[name]), name


# --- errors --------------------------------------------------------------------------------------------------


def test_missing_config(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", {"w": torch.ones(2)})
    with pytest.raises(CheckpointError, match="config.json") as info:
        open_index(folder)
    assert info.value.file == str(folder / "config.json")


def test_invalid_config_json(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": ')
    with pytest.raises(CheckpointError, match=r"config\.json.*not valid JSON"):
        open_index(folder)


def test_no_weights_lists_what_was_looked_for(tmp_path: Path) -> None:
    folder = with_config(tmp_path / "m")
    with pytest.raises(CheckpointError, match=r"model\.safetensors and model\.safetensors\.index\.json"):
        open_index(folder)


def test_pytorch_bin_not_supported(tmp_path: Path) -> None:
    folder = with_config(tmp_path / "m")
    (folder / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(CheckpointError) as info:
        open_index(folder)
    msg = str(info.value)
    assert "pytorch_model.bin" in msg and "not supported yet" in msg and "safe_serialization=True" in msg


def test_gguf_in_folder_points_at_the_file(tmp_path: Path) -> None:
    folder = with_config(tmp_path / "m")
    (folder / "model-q4.gguf").write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match=r"model-q4\.gguf: pass the \.gguf file itself"):
        open_index(folder)


def sharded_folder(tmp_path: Path) -> Path:
    folder = with_config(tmp_path / "m")
    write_sharded(folder, make_tensors().items(), max_shard_bytes=250)
    return folder


def test_missing_shard_is_named(tmp_path: Path) -> None:
    folder = sharded_folder(tmp_path)
    (folder / "model-00003-of-00005.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing") as info:
        open_index(folder)
    assert "model-00003-of-00005.safetensors" in str(info.value)


def test_index_entry_absent_from_shard(tmp_path: Path) -> None:
    folder = sharded_folder(tmp_path)
    path = folder / "model.safetensors.index.json"
    data = json.loads(path.read_text())
    data["weight_map"]["ghost.w"] = "model-00002-of-00005.safetensors"
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as info:
        open_index(folder)
    assert info.value.tensor == "ghost.w" and "model-00002-of-00005.safetensors" in str(info.value)


def test_duplicate_tensor_across_shards(tmp_path: Path) -> None:
    folder = sharded_folder(tmp_path)
    first = load_file(str(folder / "model-00001-of-00005.safetensors"))
    name = next(iter(first))
    write_safetensors(folder / "model-00002-of-00005.safetensors",
                      {**load_file(str(folder / "model-00002-of-00005.safetensors")), name: first[name]})
    with pytest.raises(CheckpointError, match="stored twice") as info:
        open_index(folder)
    assert info.value.tensor == name


def test_index_without_weight_map(tmp_path: Path) -> None:
    folder = with_config(tmp_path / "m")
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="weight_map"):
        open_index(folder)


def test_corrupt_shard_names_file(tmp_path: Path) -> None:
    folder = sharded_folder(tmp_path)
    shard = folder / "model-00004-of-00005.safetensors"
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(CheckpointError, match="3 bytes missing") as info:
        open_index(folder)
    assert info.value.file == str(shard)


# --- shard names stay inside the folder (issue 12) -------------------------------------------------------------


def _remap(folder: Path, shard: str) -> str:
    """Point the first weight_map entry at `shard`; return that entry's tensor name."""
    path = folder / "model.safetensors.index.json"
    data = json.loads(path.read_text())
    name = next(iter(data["weight_map"]))
    data["weight_map"][name] = shard
    path.write_text(json.dumps(data))
    return name


@pytest.mark.parametrize("where", ["absolute", "dotdot", "dotdot-inside", "empty", "nul", "dir"])
def test_shard_paths_outside_the_folder_are_refused(tmp_path: Path, where: str) -> None:
    folder = sharded_folder(tmp_path)
    outside = tmp_path / "outside.safetensors"  # a valid shard holding the entry's tensor, outside the folder
    first = folder / "model-00001-of-00005.safetensors"
    outside.write_bytes(first.read_bytes())
    shard = {
        "absolute": str(outside), "dotdot": "../outside.safetensors", "dotdot-inside": "sub/../../outside.safetensors",
        "empty": "", "nul": "model-00001-of-00005.safetensors\0x", "dir": "sub/",
    }[where]
    name = _remap(folder, shard)
    with pytest.raises(CheckpointError, match="not a file inside the model folder") as info:
        open_index(folder)
    assert info.value.file == str(folder / "model.safetensors.index.json") and info.value.tensor == name


def test_symlinked_shards_of_a_hub_cache_work(tmp_path: Path) -> None:
    """Hub caches store blobs/<hash> and make each snapshot file a relative symlink into ../../blobs: allowed,
    because shard names are judged by name, not by where their links resolve."""
    src = sharded_folder(tmp_path / "src")
    blobs = tmp_path / "cache" / "blobs"
    snap = tmp_path / "cache" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, p in enumerate(sorted(src.iterdir())):
        (blobs / f"blob{i}").write_bytes(p.read_bytes())
        (snap / p.name).symlink_to(Path("../../blobs") / f"blob{i}")
    index = open_index(snap)
    assert_refs_match(index, make_tensors())
    assert index.files[0].parent == snap  # the names the index gave, not the resolved blobs


def test_subfolder_shards_are_allowed(tmp_path: Path) -> None:
    folder = with_config(tmp_path / "m")
    (folder / "w").mkdir()
    tensors = make_tensors(2)
    write_safetensors(folder / "w" / "a.safetensors", tensors)
    weight_map = {name: "w/a.safetensors" for name in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_refs_match(open_index(folder), tensors)


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"weight_map": {}}', "empty"),
        ('{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}', "'a' twice"),
        ('{"weight_map": {"a": 1}}', "weight_map"),
        ('{"weight_map": ["a"]}', "weight_map"),
        ('{"weight_map": {"a": "x.safetensors"}, "metadata": ' + "[" * 100 + "]" * 100 + "}", "nested"),
        ('{"weight_map": {"a": "\\udc00.safetensors"}}', "surrogate"),
    ],
)
def test_bad_index_is_a_checkpoint_error(tmp_path: Path, text: str, words: str) -> None:
    folder = with_config(tmp_path / "m")
    (folder / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match=words) as info:
        open_index(folder)
    assert info.value.file == str(folder / "model.safetensors.index.json")
