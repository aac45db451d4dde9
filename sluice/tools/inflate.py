"""Inflate a checkpoint's experts N-fold with zeros: the same model, every expert N times the bytes.

`sluice make-model OUT --from demo --expert-scale N` (or `--size 1GiB`) rewrites a model folder so each routed
expert's intermediate size I becomes N*I: gate and up [I, H] get (N-1)*I zero rows, down [H, I] gets (N-1)*I zero
columns, and config.json's expert intermediate size is multiplied by N. Nothing else changes.

Why the output is unchanged: for the extra units, gate.x = 0 and up.x = 0, so act(0) * 0 = 0 (SiLU(0) = 0) and the
extra down columns multiply zeros. Every added term of every sum is an exact +0.0, and adding +0.0 never changes a
float; the routed weights, the router and every other tensor are byte-identical. Logits are bitwise equal only
where the matmul kernel sums the original I terms in the same order for the longer rows (true on the development
VM, not on every CPU of its kind), so tests/test_inflate.py checks the tokens exactly and the logits within float
summation-order tolerance. So a benchmark gets a model of any size whose routing, expert reuse and prefetch
accuracy are those of the trained demo model, and whose text stays readable.

Streaming: the output's safetensors headers are computed from the source headers before any byte is read; then
tensors are copied one at a time (a padded down projection is built one expert at a time), so memory stays at one
expert, whatever N. Writing goes to OUT.partial, renamed to OUT at the end, as `make-model` does.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import ModuleType

import torch

from ..checkpoint import CheckpointIndex, TensorRef
from ..errors import CheckpointError, ConfigError
from ..models import get_arch
from ..store.layout import moe_prefix
from ..units import format_bytes
from .output import writing_model
from ..plan import open_index

GiB = 2**30
SOURCES = ("demo",)  # named sources; anything else is a model folder path
_FLOATS = ("F32", "F16", "BF16")  # zero bytes are +0.0 in these; quantized blocks would need their own padding
# The fused names of transformers 5; the per-expert names are the architecture's EXPERT_PROJ (gate, up: rows; down:
# columns).
_FUSED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
_COPY_SUFFIXES = (".json", ".jinja", ".model", ".txt", ".tiktoken")
_NOT_COPIED = {"model.safetensors.index.json"}
_ZEROS = bytes(1 << 22)  # 4 MiB of zeros, written in pieces


def demo_model_dir() -> Path:
    """The trained demo model shipped inside the package (sluice/assets/demo)."""
    return Path(str(resources.files("sluice") / "assets" / "demo"))


def resolve_source(source: str | os.PathLike[str]) -> Path:
    """`demo` -> the shipped demo model; otherwise a model folder (config.json + safetensors)."""
    if str(source) == "demo":
        folder = demo_model_dir()
        if not (folder / "config.json").is_file():
            raise CheckpointError("the demo model is missing from this installation; reinstall sluice",
                                  file=str(folder))
        return folder
    folder = Path(source)
    if not folder.is_dir():
        raise ConfigError(f"--from: {str(source)!r} is neither a known source ({', '.join(SOURCES)}) "
                          "nor a model folder")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"--from: {folder} holds no config.json; pass a Hugging Face model folder")
    return folder


@dataclass(frozen=True)
class Plan:
    """What inflating `index` by `scale` writes: each output tensor's source, kind and shape, in source order.

    kind: "copy" (unchanged), "rows" (per-expert gate/up, and a shared expert sized by the experts': zero rows
    appended), "cols" (their down: zero columns appended), "fused_gate_up" ([E, 2I, H] -> [E, 2NI, H], each half
    padded), "fused_down" ([E, H, I] -> [E, H, NI]).
    """

    index: CheckpointIndex
    scale: int
    key: str  # config.json field of the expert intermediate size
    intermediate: int  # the source's I
    tensors: list[tuple[TensorRef, str, tuple[int, ...]]]

    @property
    def total_bytes(self) -> int:
        return sum(math.prod(shape) * ref.itemsize for ref, _, shape in self.tensors)

    @property
    def expert_bytes(self) -> int:
        return sum(math.prod(shape) * ref.itemsize for ref, kind, shape in self.tensors if kind != "copy")


def plan(index: CheckpointIndex, scale: int) -> Plan:
    """Check the source and list the output tensors. ConfigError / CheckpointError name what does not fit."""
    if isinstance(scale, bool) or not isinstance(scale, int) or scale < 1:
        raise ConfigError(f"--expert-scale: must be an integer >= 1, got {scale!r}")
    arch = get_arch(index.config.get("model_type"), index.folder / "config.json")
    key = arch.INTERMEDIATE_KEY  # config.json field of one routed expert's intermediate size
    gate, up, down = arch.EXPERT_PROJ
    per_expert = re.compile(rf"\.experts\.\d+\.({re.escape(gate)}|{re.escape(up)}|{re.escape(down)})\.weight$")
    I = index.config.get(key)
    if not isinstance(I, int) or I < 1:
        raise ConfigError(f"config.json {key}: expected a positive integer, got {I!r}")
    grown = _grown_with_experts(index, arch, key, I, scale)
    out: list[tuple[TensorRef, str, tuple[int, ...]]] = []
    for name in index.names():
        ref = index[name]
        kind, shape = "copy", ref.shape
        if name in grown:
            kind, shape = grown[name]
        elif m := per_expert.search(name):
            kind = "cols" if m.group(1) == down else "rows"
            axis = 0 if kind == "rows" else 1
            if len(ref.shape) != 2 or ref.shape[axis] != I:
                raise CheckpointError(f"expected {'[I, H]' if axis == 0 else '[H, I]'} with I = {key} = {I}, "
                                      f"got shape {list(ref.shape)}", file=ref.path, tensor=name)
            shape = (I * scale, ref.shape[1]) if axis == 0 else (ref.shape[0], I * scale)
        elif m := _FUSED.search(name):
            kind = "fused_" + m.group(1).removesuffix("_proj")
            want_axis, want = (1, 2 * I) if kind == "fused_gate_up" else (2, I)
            if len(ref.shape) != 3 or ref.shape[want_axis] != want:
                raise CheckpointError(f"expected a 3-D stack with {want} on axis {want_axis} ({key} = {I}), "
                                      f"got shape {list(ref.shape)}", file=ref.path, tensor=name)
            E, a, b = ref.shape
            shape = (E, a * scale, b) if kind == "fused_gate_up" else (E, a, b * scale)
        if kind != "copy" and ref.dtype not in _FLOATS:
            raise ConfigError(f"cannot inflate {ref.dtype} experts ({name}): zero padding needs "
                              f"{', '.join(_FLOATS)} weights")
        out.append((ref, kind, tuple(shape)))
    if not any(kind != "copy" for _, kind, _ in out):
        raise CheckpointError("no routed expert tensors found; nothing to inflate", file=str(index.folder))
    return Plan(index, scale, key, I, out)


def _grown_with_experts(index: CheckpointIndex, arch: ModuleType, key: str, I: int,
                        scale: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> ("rows" | "cols", output shape) for the resident tensors whose config-derived size follows the
    expert intermediate size: glm4_moe's shared experts are n_shared_experts x moe_intermediate_size wide, so they
    get the same zero units as the routed experts (exact for the same reason). Found by comparing each layer's
    tensor shapes (the architecture's layer_tensors) before and after the scaled config."""
    before = arch.ModelArgs.from_dict(index.config, index.folder / "config.json").spec()
    after = arch.ModelArgs.from_dict({**index.config, key: I * scale}, index.folder / "config.json").spec()
    out = {}
    for L in range(before.n_layers):
        moe = moe_prefix(index, arch, L) if before.moe_layers[L] else None
        for a, b in zip(arch.layer_tensors(before, L, moe), arch.layer_tensors(after, L, moe)):
            if a.shape == b.shape:
                continue
            proj = a.role.rsplit(".", 1)[-1]
            axis = 1 if proj == "down" else 0  # gate/up [n, H]: zero rows; down [H, n]: zero columns
            if (len(a.shape) != 2 or proj not in ("gate", "up", "down") or b.shape[1 - axis] != a.shape[1 - axis]
                    or b.shape[axis] != a.shape[axis] * scale):
                raise ConfigError(f"cannot inflate {a.name}: its shape {list(a.shape)} follows {key} but it is not "
                                  "an MLP projection that zero units keep exact")
            out[a.name] = ("cols" if axis else "rows", b.shape)
    return out


def scale_for_size(index: CheckpointIndex, target_bytes: int) -> int:
    """The smallest expert scale whose checkpoint reaches `target_bytes` (tensor bytes; headers add a few KiB)."""
    base = plan(index, 1)
    fixed = base.total_bytes - base.expert_bytes
    if target_bytes <= base.total_bytes:
        raise ConfigError(f"--size: {format_bytes(target_bytes)} is not larger than the source model "
                          f"({format_bytes(base.total_bytes)}); inflating only grows a model")
    return max(1, math.ceil((target_bytes - fixed) / base.expert_bytes))


def inflate(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    expert_scale: int,
    *,
    max_shard_bytes: int = GiB,
    progress: bool = True,
    force: bool = False,
) -> Path:
    """Write `source` (a model folder, or "demo") with every routed expert `expert_scale` times larger to `out`.

    Returns `out`. The result is the same model: greedy tokens and logits match the source's (see the module doc).
    """
    src = resolve_source(source)
    index = open_index(src)
    p = plan(index, expert_scale)
    if max_shard_bytes <= 0:
        raise ConfigError(f"shard size must be positive, got {max_shard_bytes}")
    out = Path(out)
    with writing_model(out, force) as partial:
        _copy_side_files(src, partial)
        config = dict(index.config)
        config[p.key] = p.intermediate * p.scale
        (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n", "utf-8")
        note = {"source": str(source), "expert_scale": p.scale, f"source_{p.key}": p.intermediate}
        (partial / "sluice_inflate.json").write_text(json.dumps(note, indent=2) + "\n", "utf-8")
        _write_shards(p, partial, max_shard_bytes, progress, out.name)
    return out


def _copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, chat template, generation config...: every small file a model folder carries, but the weights."""
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix in _COPY_SUFFIXES and f.name not in _NOT_COPIED and not f.name.startswith("."):
            shutil.copyfile(f, dst / f.name)


# -- writing ---------------------------------------------------------------------------------------------------------
def _shards(p: Plan, max_shard_bytes: int) -> list[list[tuple[TensorRef, str, tuple[int, ...]]]]:
    """Group output tensors in order, like write_sharded: a shard closes before the tensor that would overflow."""
    shards: list[list] = [[]]
    size = 0
    for item in p.tensors:
        ref, _, shape = item
        nbytes = math.prod(shape) * ref.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    return shards


def _header(items: list[tuple[TensorRef, str, tuple[int, ...]]]) -> bytes:
    """A safetensors header in write_safetensors' format (compact JSON, padded to 8 bytes)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for ref, _, shape in items:
        nbytes = math.prod(shape) * ref.itemsize
        header[ref.name] = {"dtype": ref.dtype, "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)


def _write_shards(p: Plan, folder: Path, max_shard_bytes: int, progress: bool, name: str) -> None:
    shards = _shards(p, max_shard_bytes)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=p.total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=f"inflating {name}")
    files: dict[str, int] = {}
    try:
        for items, fname in zip(shards, names):
            with open(folder / fname, "wb") as f:
                raw = _header(items)
                f.write(struct.pack("<Q", len(raw)))
                f.write(raw)
                for ref, kind, shape in items:
                    fd = files.get(ref.path)
                    if fd is None:
                        fd = files[ref.path] = os.open(ref.path, os.O_RDONLY)
                    for chunk in _tensor_bytes(fd, ref, kind, p.scale):
                        f.write(chunk)
                        if bar is not None:
                            bar.update(len(chunk))
    finally:
        for fd in files.values():
            os.close(fd)
        if bar is not None:
            bar.close()
    if n > 1:
        weight_map = {ref.name: fname for items, fname in zip(shards, names) for ref, _, _ in items}
        index = {"metadata": {"total_size": p.total_bytes}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", "utf-8")


def _read(fd: int, offset: int, nbytes: int, ref: TensorRef) -> bytes:
    data = os.pread(fd, nbytes, offset)
    if len(data) != nbytes:
        raise CheckpointError(f"short read: {len(data)} of {nbytes} bytes at offset {offset}",
                              file=ref.path, tensor=ref.name)
    return data


def _zeros(nbytes: int) -> Iterator[bytes | memoryview]:
    view = memoryview(_ZEROS)
    while nbytes > 0:
        n = min(nbytes, len(_ZEROS))
        yield view[:n]
        nbytes -= n


def _pad_columns(data: bytes, rows: int, cols: int, scale: int, ref: TensorRef) -> bytes:
    """[rows, cols] -> [rows, cols * scale], the original values first in each row, then zeros."""
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(rows, cols * ref.itemsize)
    out = torch.zeros(rows, cols * scale * ref.itemsize, dtype=torch.uint8)
    out[:, : cols * ref.itemsize] = src
    return out.numpy().tobytes()


def _tensor_bytes(fd: int, ref: TensorRef, kind: str, scale: int) -> Iterator[bytes | memoryview]:
    """The output bytes of one tensor, in pieces of at most one source expert (plus zeros)."""
    if kind == "copy":
        step = 64 * 2**20
        for start in range(0, ref.nbytes, step):
            yield _read(fd, ref.offset + start, min(step, ref.nbytes - start), ref)
    elif kind == "rows":  # [I, H]: the rows are contiguous, so the padding is a run of zeros after them
        yield _read(fd, ref.offset, ref.nbytes, ref)
        yield from _zeros(ref.nbytes * (scale - 1))
    elif kind == "cols":  # [H, I]
        yield _pad_columns(_read(fd, ref.offset, ref.nbytes, ref), ref.shape[0], ref.shape[1], scale, ref)
    elif kind == "fused_gate_up":  # [E, 2I, H]: per expert, gate rows + zeros, up rows + zeros
        E, two_i, H = ref.shape
        half = two_i // 2 * H * ref.itemsize
        for e in range(E):
            for part in range(2):
                yield _read(fd, ref.offset + (2 * e + part) * half, half, ref)
                yield from _zeros(half * (scale - 1))
    elif kind == "fused_down":  # [E, H, I]
        E, H, I = ref.shape
        per = H * I * ref.itemsize
        for e in range(E):
            yield _pad_columns(_read(fd, ref.offset + e * per, per, ref), H, I, scale, ref)
    else:
        raise AssertionError(kind)


def describe(p: Plan) -> str:
    """One line for summaries."""
    return (f"{p.index.config.get('model_type')}: experts of intermediate {p.intermediate} -> "
            f"{p.intermediate * p.scale} (x{p.scale}), {format_bytes(p.total_bytes)} of tensors, experts "
            f"{p.expert_bytes / p.total_bytes:.1%}")
