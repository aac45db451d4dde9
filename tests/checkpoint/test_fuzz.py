"""Seeded fuzzing of what the checkpoint layer parses: safetensors headers, the shard index and config.json.

For every mutated file: sluice either raises a SluiceError (anything else fails), or accepts it, and then the
reference must accept it too and every tensor must be exactly the bytes the reference reads (dtype, shape, bytes;
names and metadata). No case may take more than a few seconds (a watchdog timer turns a hang into a failure).

Mutations: bit flips and small deltas in the length field, byte edits in the header, truncations and extensions of
the file, data_offsets / dtype / shape edits, deep nesting, huge numbers, duplicate keys, non-UTF-8 bytes, lone
surrogates, NaN / Infinity / -0, leading whitespace; for the index: wrong types, missing shards, wrong shards, path
tricks (absolute, '..', NUL, empty, overlong names); for config.json: byte edits and hostile JSON.
"""

from __future__ import annotations

import json
import random
import re
import signal
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from sluice.checkpoint import read_header, write_sharded
from sluice.checkpoint.ref import DTYPES
from sluice.errors import SluiceError
from sluice.quant.tensor import read_tensor
from sluice.plan import open_index

SEED = 12
HEADER_CASES = 2500
INDEX_CASES = 500
CONFIG_CASES = 300
CASE_LIMIT_S = 5.0  # a watchdog per case: a hang fails the test instead of stalling the suite


@contextmanager
def watchdog(seconds: float) -> Iterator[None]:
    """TimeoutError in this thread when the block runs longer than `seconds` (SIGALRM; main thread only)."""

    def fire(signum, frame):  # noqa: ANN001
        raise TimeoutError(f"a case ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def rewrite(path: Path, data: bytes) -> None:
    """Write `data` as a NEW file at `path`: ext4 flushes a file truncated by an overwrite (~6 ms each here), a
    fresh one costs ~0.2 ms."""
    path.unlink(missing_ok=True)
    path.write_bytes(data)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def base_files() -> list[bytes]:
    """Valid files written by the reference: several dtypes, a scalar, empty tensors, metadata or none."""
    g = torch.Generator().manual_seed(SEED)
    files = [
        save({"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g).bfloat16(),
              "i": torch.arange(5, dtype=torch.int64)}, metadata={"format": "pt"}),
        save({"s": torch.tensor(2.5), "e": torch.zeros(0, 3), "u": torch.randint(0, 255, (7,), dtype=torch.uint8),
              "h": torch.randn(2, 2, generator=g).half(), "f8": torch.randn(6, generator=g).to(torch.float8_e4m3fn)}),
        save({"only": torch.randn(16, generator=g)}, metadata={"a": "1", "b": "two"}),
        save({}),
        save({"bool": torch.rand(9, generator=g) > 0.5, "z": torch.zeros(2, 0, dtype=torch.bfloat16),
              "d": torch.randn(3, generator=g, dtype=torch.float64)}),
    ]
    return files


class NotApplicable(Exception):
    """A mutator that needs a length prefix met a file shorter than 8 bytes: the file stays as it is."""


def split(blob: bytes) -> tuple[int, bytes, bytes]:
    if len(blob) < 8:
        raise NotApplicable
    (n,) = struct.unpack("<Q", blob[:8])
    return n, blob[8 : 8 + n], blob[8 + n :]


def mutate(rng: random.Random, blob: bytes, mutators: list) -> bytes:
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        try:
            blob = rng.choice(mutators)(rng, blob)
        except NotApplicable:
            pass
    return blob


def pack(header: bytes, data: bytes, *, pad: bool = True, length: int | None = None) -> bytes:
    if pad:
        header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header) if length is None else length) + header + data


# --- safetensors mutators: (rng, blob) -> bytes --------------------------------------------------------------------

TOKENS = [b"{", b"}", b"[", b"]", b",", b":", b'"', b"0", b"-0", b"9" * 30, b"9" * 5000, b"NaN", b"Infinity",
          b"1e999", b"1e-400", b"1.5", b"true", b"null", b"\xff", b"\x00", b"\\ud800", b"\\u0000", b" ", b"\t",
          b"-1", b"18446744073709551616", b"9223372036854775808"]


def flip_length_bit(rng: random.Random, blob: bytes) -> bytes:
    split(blob)  # NotApplicable when shorter than the length field
    b = bytearray(blob)
    i = rng.randrange(8 * 8)
    b[i // 8] ^= 1 << (i % 8)
    return bytes(b)


def nudge_length(rng: random.Random, blob: bytes) -> bytes:
    n, header, data = split(blob)
    return struct.pack("<Q", max(0, n + rng.choice([-9, -8, -7, -3, -2, -1, 1, 2, 3, 7, 8, 9]))) + blob[8:]


def edit_header_byte(rng: random.Random, blob: bytes) -> bytes:
    n, header, data = split(blob)
    if not header:
        return blob
    b = bytearray(header)
    for _ in range(rng.choice([1, 1, 2, 4])):
        b[rng.randrange(len(b))] = rng.randrange(256) if rng.random() < 0.5 else rng.choice(b'{}[]",:0123456789- ')
    return blob[:8] + bytes(b) + data


def insert_token(rng: random.Random, blob: bytes) -> bytes:
    n, header, data = split(blob)
    text = header.rstrip(b" ")
    i = rng.randrange(len(text) + 1)
    new = text[:i] + rng.choice(TOKENS) + text[i:]
    return pack(new, data, pad=rng.random() < 0.5)


def truncate_file(rng: random.Random, blob: bytes) -> bytes:
    return blob[: rng.randrange(len(blob))]


def extend_file(rng: random.Random, blob: bytes) -> bytes:
    return blob + bytes(rng.randrange(256) for _ in range(rng.choice([1, 2, 7, 8, 64])))


def leading_space(rng: random.Random, blob: bytes) -> bytes:
    n, header, data = split(blob)
    return pack(rng.choice([b" ", b"\n", b"\t"]) + header.rstrip(b" "), data)


HUGE = "@huge@"  # stands for a 5000-digit integer, which json.dumps refuses to write: replaced in the text


def parse(header: bytes) -> object:
    """The header as JSON, or None when an earlier mutation already broke it (then a JSON mutator passes)."""
    try:
        return json.loads(header)
    except (ValueError, RecursionError):
        return None


def deep(depth: int, inner: str = "1") -> str:
    """Stands for `depth` nested lists around `inner` (json.dumps would hit the recursion limit): see dumps."""
    return f"@deep{depth}:{inner}@"


def dumps(obj: object, **kw) -> bytes:
    text = json.dumps(obj, **kw).encode("utf-8", "surrogatepass")
    text = text.replace(b'"' + HUGE.encode() + b'"', b"7" * 5000)
    return re.sub(rb'"@deep(\d+):([^@]*)@"', lambda m: b"[" * int(m[1]) + m[2] + b"]" * int(m[1]), text)


def _json_mutator(edit: Callable[[random.Random, dict], object]) -> Callable[[random.Random, bytes], bytes]:
    """Parse the header, let `edit` change the object, re-serialize (json.dumps: NaN/Infinity come out as such)."""

    def mutate(rng: random.Random, blob: bytes) -> bytes:
        n, header, data = split(blob)
        obj = parse(header)
        if not isinstance(obj, dict) or not all(isinstance(v, dict) for v in obj.values()):
            return blob
        if any(not isinstance(v.get(k), list) for k, v in obj.items() if k != "__metadata__"
               for k in ("shape", "data_offsets")):
            return blob
        new = edit(rng, obj)
        text = dumps(obj if new is None else new, separators=(",", ":"), ensure_ascii=rng.random() < 0.5)
        return pack(text, data, pad=rng.random() < 0.8)

    mutate.__name__ = edit.__name__
    return mutate


def _tensor(rng: random.Random, obj: dict) -> dict | None:
    names = [k for k in obj if k != "__metadata__"]
    return obj[rng.choice(names)] if names else None


WEIRD = [0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30, 1.0, -0.0, True, None, "3", [], [1], {},
         float("nan"), float("inf"), [[1]], HUGE]


def edit_offsets(rng: random.Random, obj: dict) -> None:
    t = _tensor(rng, obj)
    if t is None:
        return
    off = t["data_offsets"]
    choice = rng.randrange(5)
    if choice == 0:
        off[rng.randrange(2)] += rng.choice([-8, -4, -2, -1, 1, 2, 4, 8])
    elif choice == 1:
        off.reverse()
    elif choice == 2:
        off[rng.randrange(2)] = rng.choice(WEIRD)
    elif choice == 3:
        t["data_offsets"] = rng.choice([[0], [0, 0, 0], "0,4", None, {"0": 4}])
    else:
        shift = rng.choice([-2, 2, 8])
        t["data_offsets"] = [off[0] + shift, off[1] + shift]


def edit_dtype(rng: random.Random, obj: dict) -> None:
    t = _tensor(rng, obj)
    if t is not None:
        t["dtype"] = rng.choice([*DTYPES, "U16", "U64", "F4", "f32", "", 4, None, ["F32"]])


def edit_shape(rng: random.Random, obj: dict) -> None:
    t = _tensor(rng, obj)
    if t is None:
        return
    shape = t["shape"]
    choice = rng.randrange(5)
    if choice == 0 and shape:
        shape[rng.randrange(len(shape))] = rng.choice(WEIRD)
    elif choice == 1:
        shape.insert(rng.randrange(len(shape) + 1), rng.choice([0, 1, 2, 2**63, 2**64 - 1]))
    elif choice == 2 and shape:
        shape.pop()
    elif choice == 3:
        shape.reverse()
    else:
        t["shape"] = rng.choice(["[2]", None, {"0": 2}, [0] * 1000 + [2**62] * 3, [1] * 2000])


def edit_structure(rng: random.Random, obj: dict) -> object:
    names = [k for k in obj if k != "__metadata__"]
    choice = rng.randrange(9)
    if choice == 0 and names:
        del obj[rng.choice(names)][rng.choice(["dtype", "shape", "data_offsets"])]
    elif choice == 1 and names:
        obj[rng.choice(names)] = rng.choice([[], "x", None, 3, [1, 2]])
    elif choice == 2:
        target = obj[names[0]] if names else obj
        target["x" if names else "__metadata__"] = deep(rng.choice([10, 61, 62, 63, 100, 126, 200, 3000]))
    elif choice == 3:
        obj["__metadata__"] = rng.choice([{"a": 1}, {"a": None}, [], "x", None, {"a": "b"}, {"a": {"b": "c"}}])
    elif choice == 4 and names:
        name = rng.choice(names)
        obj[name + rng.choice(["\ud800", "\udfff", "\x00", "é", "\U0001f600"])] = obj.pop(name)
    elif choice == 5:
        return rng.choice([[obj], "header", 3, None, [], True])
    elif choice == 6 and names:
        obj[rng.choice(names)]["extra"] = rng.choice([HUGE, float("nan"), -0.0, "\ud800", {"k": [1, 2]}])
    elif choice == 7 and names:  # a second name for the same bytes
        obj[names[0] + "_copy"] = dict(obj[names[0]])
    else:
        obj.clear()
    return None


def duplicate_entry(rng: random.Random, blob: bytes) -> bytes:
    """A key repeated in the raw text (json.dumps cannot write one): top level, or a field inside an entry."""
    n, header, data = split(blob)
    text = header.rstrip(b" ")
    obj = parse(text)
    names = [k for k, v in obj.items() if k != "__metadata__" and isinstance(v, dict)] if isinstance(obj, dict) else []
    if not names or not all(f in obj[n] for n in names for f in ("dtype", "shape", "data_offsets")):
        return blob
    name = rng.choice(names)
    entry = json.dumps({name: obj[name]}, separators=(",", ":"))[1:-1].encode()
    if rng.random() < 0.5:
        new = text[:-1] + b"," + entry + b"}"
    else:
        field = rng.choice(["dtype", "shape", "data_offsets"])
        inner = json.dumps(obj[name][field]).encode()
        new = text.replace(entry, entry[:-1] + b',"' + field.encode() + b'":' + inner + b"}", 1)
    return pack(new, data)


HEADER_MUTATORS: list[Callable[[random.Random, bytes], bytes]] = [
    flip_length_bit, nudge_length, edit_header_byte, insert_token, truncate_file, extend_file, leading_space,
    _json_mutator(edit_offsets), _json_mutator(edit_dtype), _json_mutator(edit_shape),
    _json_mutator(edit_structure), duplicate_entry,
]


def sluice_matches_reference(path: Path) -> bool:
    """False when sluice refuses the file (a SluiceError); True when it accepts it and the reference reads the very
    same tensors. Any other exception from sluice, or a disagreement, fails the test."""
    try:
        refs, meta = read_header(path)
        tensors = {name: read_tensor(ref) for name, ref in refs.items()}
    except SluiceError:
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            assert set(f.keys()) == set(refs), "the reference lists other tensors"
            assert (f.metadata() or {}) == meta, "the reference reads other metadata"
            for name, ours in tensors.items():
                theirs = f.get_tensor(name)
                assert theirs.dtype == ours.dtype and tuple(theirs.shape) == tuple(ours.shape), name
                assert raw(theirs) == raw(ours), f"tensor {name!r}: sluice reads other bytes than the reference"
    except Exception as e:  # noqa: BLE001 - re-raised as a failure that shows the file
        raise AssertionError(f"sluice accepted a file the reference does not read the same: {e!r}") from e
    return True


def test_fuzz_safetensors_headers(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    bases = base_files()
    path = tmp_path / "fuzz.safetensors"
    accepted = 0
    for case in range(HEADER_CASES):
        blob = mutate(rng, rng.choice(bases), HEADER_MUTATORS)
        rewrite(path, blob)
        try:
            with watchdog(CASE_LIMIT_S):
                accepted += sluice_matches_reference(path)
        except BaseException as e:
            (tmp_path / f"failing-{case}.safetensors").write_bytes(blob)
            raise AssertionError(f"case {case} (seed {SEED}): {type(e).__name__}: {e}; file kept as "
                                 f"failing-{case}.safetensors, header {blob[:300]!r}") from e
    # the fuzz exercises both paths: plenty of files are refused, and some mutations keep a valid file
    assert 0.01 * HEADER_CASES < accepted < 0.6 * HEADER_CASES, accepted


# --- the shard index ---------------------------------------------------------------------------------------------


def sharded_model(folder: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    tensors = {f"layers.{i}.w": torch.randn(6, generator=g) for i in range(6)}
    tensors["embed"] = torch.randn(2, 3, generator=g).bfloat16()
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    files = write_sharded(folder, tensors.items(), max_shard_bytes=60)
    assert [p.name for p in files] == [f"model-0000{i}-of-00003.safetensors" for i in range(1, 4)]
    return tensors


PATHS = ["/etc/passwd", "../x.safetensors", "a/../../x", "./model-00001-of-00003.safetensors", "", "\x00",
         "model-00001-of-00003.safetensors\x00", "x" * 300, "nope.safetensors", "sub/", ".", "..", "/",
         "model-00002-of-00003.safetensors", "config.json", "\ud800.safetensors", "é.safetensors"]


def mutate_index(rng: random.Random, index: dict) -> bytes:
    wm = index["weight_map"]
    names = list(wm)
    choice = rng.randrange(10)
    if choice == 0:
        index["weight_map"] = rng.choice([[], "x", None, 3, [["a", "b"]], {}])
    elif choice == 1:
        wm[rng.choice(names)] = rng.choice([1, None, [], {}, True, 1.5])
    elif choice in (2, 3, 4):
        wm[rng.choice(names)] = rng.choice(PATHS)
    elif choice == 5:
        del wm[rng.choice(names)]
    elif choice == 6:
        wm["ghost"] = rng.choice(sorted(set(wm.values())))
    elif choice == 7:
        index["metadata"] = rng.choice([{"total_size": HUGE}, [[[]]], None, {"x": float("nan")}])
    elif choice == 8:
        index["metadata"] = deep(rng.choice([50, 62, 63, 70, 2000]), '"x"')
    else:
        del index["weight_map"]
    text = dumps(index)
    if rng.random() < 0.2:  # raw edits on top: duplicate keys, bad bytes, truncation
        edit = rng.randrange(3)
        if edit == 0 and names and isinstance(index.get("weight_map"), dict) and names[0] in index["weight_map"]:
            dup = json.dumps({names[0]: "model-00003-of-00003.safetensors"})[1:-1].encode()
            text = text.replace(b'"weight_map": {', b'"weight_map": {' + dup + b", ", 1)
        elif edit == 1:
            i = rng.randrange(len(text))
            text = text[:i] + rng.choice([b"\xff", b"\x00", b"\\udc00", b"}", b"9" * 5000]) + text[i + 1 :]
        else:
            text = text[: rng.randrange(len(text))]
    return text


def check_index(folder: Path) -> bool:
    """Like sluice_matches_reference, for a whole folder: every tensor the index maps is the reference's bytes."""
    try:
        index = open_index(folder)
        tensors = {name: read_tensor(index[name]) for name in index}
    except SluiceError:
        return False
    for name, ours in tensors.items():
        path = index[name].path
        assert Path(path).resolve().is_relative_to(folder.resolve()), f"{name} read from {path}, outside"
        with safe_open(path, framework="pt") as f:
            theirs = f.get_tensor(name)
        assert theirs.dtype == ours.dtype and raw(theirs) == raw(ours), name
    return True


def test_fuzz_shard_index(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    sharded_model(folder)
    (tmp_path / "x.safetensors").write_bytes((folder / "model-00001-of-00003.safetensors").read_bytes())
    index_path = folder / "model.safetensors.index.json"
    original = json.loads(index_path.read_text())
    assert check_index(folder)
    rng = random.Random(SEED)
    accepted = 0
    for case in range(INDEX_CASES):
        text = mutate_index(rng, json.loads(json.dumps(original)))
        rewrite(index_path, text)
        try:
            with watchdog(CASE_LIMIT_S):
                accepted += check_index(folder)
        except BaseException as e:
            raise AssertionError(f"case {case} (seed {SEED}): {type(e).__name__}: {e}; index {text[:300]!r}") from e
    assert 0 < accepted < INDEX_CASES / 2, accepted


# --- config.json (its values are models/args.py's business; here: parsing never escapes) -------------------------


def test_fuzz_config_json(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    from sluice.checkpoint import write_safetensors

    write_safetensors(folder / "model.safetensors", {"w": torch.ones(2)})
    good = json.dumps({"model_type": "qwen3_moe", "hidden_size": 64, "rope_scaling": {"type": "yarn", "factor": 2.0},
                       "eos_token_id": [1, 2], "name": "tiny"}).encode()
    rng = random.Random(SEED)
    for case in range(CONFIG_CASES):
        b = bytearray(good)
        for _ in range(rng.choice([1, 2, 3])):
            i = rng.randrange(len(b) + 1)
            b[i:i + rng.choice([0, 1])] = rng.choice(TOKENS + [b"[" * 5000, b'{"a":' * 100])
        rewrite(folder / "config.json", bytes(b))
        try:
            with watchdog(CASE_LIMIT_S):
                open_index(folder)
        except SluiceError:
            pass
        except BaseException as e:
            raise AssertionError(
                f"case {case} (seed {SEED}): {type(e).__name__}: {e}; config {bytes(b)[:300]!r}"
            ) from e


@pytest.mark.parametrize("seed", [1, 2])
def test_mutators_are_deterministic(seed: int) -> None:
    """Same seed, same files: a failure is reproducible from the seed in its message."""
    blobs = []
    for _ in range(2):
        rng = random.Random(seed)
        blobs.append([m(rng, base_files()[0]) for m in HEADER_MUTATORS])
    assert blobs[0] == blobs[1]
