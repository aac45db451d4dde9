"""CheckpointIndex: a Hugging Face model folder as config + tensor name -> TensorRef. No tensor bytes are read."""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path, PurePosixPath

import torch

from sluice.checkpoint.fp8_index import fp8_tensors
from sluice.checkpoint.jsonfile import read_json
from sluice.checkpoint.mlx_index import is_mlx, mlx_tensors
from sluice.checkpoint.multimodal import text_config, text_tensors
from sluice.checkpoint.paths import path_kind
from sluice.checkpoint.ref import FileStamp, TensorRef
from sluice.checkpoint.safetensors import read_header, write_safetensors
from sluice.errors import CheckpointError

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_CONVERT = (
    "convert it with transformers: AutoModelForCausalLM.from_pretrained(folder)"
    ".save_pretrained(out, safe_serialization=True)"
)


class CheckpointIndex:
    """A model folder: `config`, `generation_config`, and where every tensor's bytes are (`tensors`, `files`)."""

    def __init__(
        self,
        folder: Path,
        config: dict,
        generation_config: dict | None,
        tensors: dict[str, TensorRef],
        files: list[Path],
    ):
        self.folder = folder
        self.config = config
        self.generation_config = generation_config
        self.tensors = tensors
        self.files = files

    @classmethod
    def open(cls, folder: str | os.PathLike[str], mlx_values: Mapping[str, Mapping[str, str]] | None = None
             ) -> CheckpointIndex:
        """Read config.json, generation_config.json (optional) and every safetensors header in `folder`.

        Weights come from `model.safetensors`, else from the shards named by `model.safetensors.index.json`
        (the order transformers uses). An MLX folder (mlx-lm's `quantization` in config.json, or its stacked
        `switch_mlp` experts) is presented under sluice's names, quantized modules dequantizable, values mlx-lm
        changed marked (`mlx_values`: model_type -> the architecture's MLX_VALUES; mlx_index.py); an FP8
        folder's weights carry their block scales (quantization_config quant_method "fp8": fp8_index.py); a
        multimodal checkpoint (the hub's Qwen3.5) as its text model (multimodal.py). A GGUF file has its own class
        (gguf_index.py); open.open_index picks between them. Raises
        CheckpointError for a missing/invalid config, missing weights, a missing shard, an index entry absent from
        its shard, a tensor stored twice, or any bad header.
        """
        folder = Path(folder)
        try:
            kind = path_kind(folder)
        except OSError as e:  # a name too long, a permission denied on a parent
            raise CheckpointError(f"cannot open: {e.strerror or e}", file=str(folder)) from None
        if kind != "directory":
            what = {"missing": "not found", "file": "is a file, not a folder (a GGUF file's name ends in .gguf)"}
            raise CheckpointError(f"{what.get(kind, 'is ' + kind)}; pass a Hugging Face model folder or a .gguf file",
                                  file=str(folder))
        config = read_json(folder / CONFIG)
        gen_path = folder / GENERATION_CONFIG
        generation_config = read_json(gen_path) if gen_path.exists() else None

        if (folder / SINGLE).is_file():
            files = [folder / SINGLE]
            tensors, _ = read_header(files[0])
        elif (folder / INDEX).is_file():
            tensors, files = _read_sharded(folder)
        else:
            raise _no_weights(folder)
        config, tensors = text_config(config), text_tensors(tensors)  # a vision-language wrapper: its text model
        tensors = fp8_tensors(tensors, config, folder / CONFIG)  # FP8 weights carry their block scales (fp8_index.py)
        if is_mlx(config, tensors):  # mlx-lm's names and affine-quantized modules, see mlx_index.py
            values = (mlx_values or {}).get(config.get("model_type"))
            tensors = mlx_tensors(tensors, config, folder / CONFIG, values)
        return cls(folder, config, generation_config, tensors, files)

    def __getitem__(self, name: str) -> TensorRef:
        try:
            return self.tensors[name]
        except KeyError:
            pass
        close = difflib.get_close_matches(name, self.tensors.keys(), n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise CheckpointError(f"no such tensor in {self.folder}{hint}", tensor=name) from None

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def names(self) -> list[str]:
        """All tensor names, in file order (shard by shard, header order within a shard)."""
        return list(self.tensors)

    def stamps(self) -> list[FileStamp]:
        """The version of each weight file whose header was read (hand them to a reader's `expect`)."""
        out = {r.stamp.path: r.stamp for r in self.tensors.values() if r.stamp is not None}
        return list(out.values())

    def total_bytes(self) -> int:
        """Sum of all tensors' byte sizes (the weights' on-disk footprint, headers excluded)."""
        return sum(r.nbytes for r in self.tensors.values())

    def __repr__(self) -> str:
        return (f"CheckpointIndex({str(self.folder)!r}, tensors={len(self.tensors)}, files={len(self.files)}, "
                f"bytes={self.total_bytes()})")


def _read_sharded(folder: Path) -> tuple[dict[str, TensorRef], list[Path]]:
    index_path = folder / INDEX
    index = read_json(index_path, unique_keys=True)  # one tensor mapped twice is ambiguous: refused
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError("lacks a \"weight_map\" object of tensor name -> shard file; re-download it",
                              file=str(index_path))
    if not weight_map:
        raise CheckpointError("has an empty \"weight_map\": it lists no tensors; re-download it", file=str(index_path))

    shard_names = list(dict.fromkeys(weight_map.values()))  # first-appearance order, deduplicated
    for shard in shard_names:
        _check_shard_name(shard, weight_map, index_path)
    tensors: dict[str, TensorRef] = {}
    files: list[Path] = []
    for shard in shard_names:
        path = folder / shard
        try:
            found = path.is_file()
        except OSError as e:  # ENAMETOOLONG, EACCES, ...: pathlib only swallows "does not exist"
            raise CheckpointError(f"listed in {INDEX} but cannot be looked up: {e.strerror or e}; re-download the "
                                  "index", file=str(path)) from None
        if not found:
            raise CheckpointError(f"listed in {INDEX} but missing from {folder}; download it", file=str(path))
        refs, _ = read_header(path)
        for name, ref in refs.items():
            if name in tensors:
                raise CheckpointError(
                    f"stored twice, in {Path(tensors[name].path).name} and {shard}; the checkpoint is "
                    "inconsistent, re-download it", file=str(path), tensor=name,
                )
            tensors[name] = ref
        files.append(path)

    for name, shard in weight_map.items():
        ref = tensors.get(name)
        if ref is None or ref.path != str(folder / shard):
            raise CheckpointError(
                f"{INDEX} places it in {shard}, but that shard's header does not list it; "
                "re-download the shard and the index", file=str(folder / shard), tensor=name,
            )
    return tensors, files


def _check_shard_name(shard: str, weight_map: dict[str, str], index_path: Path) -> None:
    """A shard must be named by a relative path inside the model folder: no absolute path, no `..`, no empty or
    NUL-holding name. Judged by the NAME only, not by resolving links: hub caches make every shard a symlink
    into ../../blobs/, and those must keep working."""
    parts = PurePosixPath(shard).parts
    if not parts or "\0" in shard or os.path.isabs(shard) or ".." in parts or shard.endswith("/"):
        tensor = next(name for name, s in weight_map.items() if s == shard)
        raise CheckpointError(
            f"weight_map puts it in shard {shard[:200]!r}, which is not a file inside the model folder (absolute "
            "paths and '..' are refused); re-download the index",
            file=str(index_path), tensor=tensor,
        )


def _no_weights(folder: Path) -> CheckpointError:
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    pickles = [n for n in names if n.endswith((".bin", ".pt", ".pth"))]
    ggufs = [n for n in names if n.endswith(".gguf")]
    others = [n for n in names if n.endswith(".safetensors")]
    looked = f"looked for {SINGLE} and {INDEX}"
    if others:
        hint = (f"found {', '.join(others[:3])}, but without {INDEX} sluice cannot tell which tensors they hold "
                f"as one model; rename a single file to {SINGLE} or add the index")
    elif pickles:
        hint = f"found {', '.join(pickles[:3])}: PyTorch pickle checkpoints are not supported yet; {_CONVERT}"
    elif ggufs:
        hint = f"found {', '.join(ggufs[:3])}: pass the .gguf file itself (the first split of a split set)"
    else:
        hint = "the folder holds no weights"
    return CheckpointError(f"no safetensors weights ({looked}); {hint}", file=str(folder))


def write_sharded(
    folder: str | os.PathLike[str],
    tensors: Iterable[tuple[str, torch.Tensor]],
    max_shard_bytes: int,
    progress: bool = False,
) -> list[Path]:
    """Stream `(name, tensor)` pairs into hub-style shards in `folder`; return the weight files written.

    Holds at most one shard's worth of tensors (a tensor larger than `max_shard_bytes` gets a shard alone), so
    a generator can produce more bytes than fit in memory. Writes `model-0000i-of-0000N.safetensors` plus
    `model.safetensors.index.json`, or a single `model.safetensors` when everything fits in one shard. Shards
    are written under temporary names and renamed once N is known; on error the temporaries are removed.
    Stale files of the other layout (an old index, old single file or old shards) are deleted afterwards so
    CheckpointIndex.open never picks them up.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    bar = _progress_bar() if progress else None
    on_written = bar.update if bar is not None else None

    temps: list[Path] = []
    shard_names: list[list[str]] = []  # tensor names per shard
    seen: set[str] = set()
    total = 0
    buffer: dict[str, torch.Tensor] = {}
    buffered = 0

    def flush() -> None:
        nonlocal buffer, buffered
        tmp = folder / f".sluice-shard-{len(temps) + 1:05d}.{os.getpid()}.partial"
        temps.append(tmp)
        write_safetensors(tmp, buffer, {"format": "pt"}, on_written=on_written)
        shard_names.append(list(buffer))
        buffer, buffered = {}, 0

    try:
        for name, t in tensors:
            if name in seen:
                raise ValueError(f"tensor {name!r} given twice")
            seen.add(name)
            nbytes = t.numel() * t.element_size()
            if buffer and buffered + nbytes > max_shard_bytes:
                flush()
            buffer[name] = t
            buffered += nbytes
            total += nbytes
        if buffer or not temps:
            flush()
        written = _finish(folder, temps, shard_names, total)
    except BaseException:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    return written


def _progress_bar():  # noqa: ANN202 (tqdm's type is not worth importing at module load)
    from tqdm import tqdm

    return tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc="writing shards")


def _finish(folder: Path, temps: list[Path], shard_names: list[list[str]], total: int) -> list[Path]:
    """Rename the temporary shards to their final names, write the index, drop stale files of the layout."""
    n = len(temps)
    if n == 1:
        final = [folder / SINGLE]
    else:
        final = [folder / f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    for tmp, dst in zip(temps, final):
        os.replace(tmp, dst)

    if n > 1:
        weight_map = {name: dst.name for names, dst in zip(shard_names, final) for name in names}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        tmp = folder / f".{INDEX}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, folder / INDEX)  # the index goes in last: it is what makes the shards a checkpoint

    keep = {p.name for p in final}
    for p in folder.iterdir():
        stale_index = n == 1 and p.name == INDEX
        stale_weights = (p.name == SINGLE or _SHARD_RE.fullmatch(p.name)) and p.name not in keep
        if stale_index or stale_weights:
            p.unlink()
    return final
