"""JSON as the checkpoint layer reads it: every failure of a hostile file is a CheckpointError naming the file.

Python's `json` lets several things out that are not JSON errors: RecursionError on deep nesting, ValueError on an
integer of more than 4300 digits, and strings holding lone UTF-16 surrogates (`"\\ud800"` parses, then breaks
whatever encodes the string later). `loads` turns all of them into CheckpointError, refuses nesting deeper than
MAX_DEPTH (no checkpoint file nests more than ~5 levels; code that walks a parsed value recursively would otherwise
fail later, far from the file), and, with `reference=True`, also refuses what serde_json (the parser of the Rust
safetensors reference) refuses but Python accepts: NaN / Infinity, floats out of range, and `-0` where an integer
is expected (serde reads it as a float). So a safetensors header sluice accepts is one the reference accepts too.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO

from sluice.errors import CheckpointError

# Deepest nesting accepted. Checkpoint JSON (configs, indexes, tokenizer configs, safetensors headers) nests <= 5
# levels; serde_json's own limit is 128, Python's recursion limit ~1000.
MAX_DEPTH = 64
# Side files (config.json, generation_config.json, the shard index, tokenizer_config.json) are KBs to a few MB
# (the index of a 1T-parameter model is ~3 MB); a bigger one is not what its name says. Refused before reading it
# whole, so a hostile file cannot exhaust memory. Same bound as the safetensors header (the reference's 100 MB).
MAX_FILE_BYTES = 100_000_000
# A JSON string escape of a UTF-16 surrogate (D800-DFFF). Valid pairs decode to one code point; a lone one stays a
# surrogate in the Python string. Only when this matches is the parsed value walked for surrogates.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# `-0` in value position, which serde_json parses as a float (-0.0), not an integer.
_NEGATIVE_ZERO = re.compile(r"[\[,:]\s*-0\s*[\],}]")


class _Refused(ValueError):
    """Raised from inside json.loads' hooks; `reason` completes "<what> ..." in the error message."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _no_constant(name: str) -> Any:
    raise _Refused(f"holds {name}, which is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _Refused(f"holds the number {text[:40]}, out of the range of a float")
    return value


def _int_not_negative_zero(text: str) -> int | float:
    return -0.0 if text == "-0" else int(text)


def loads(
    raw: bytes,
    file: str,
    *,
    what: str = "",
    unique_keys: bool = False,
    reference: bool = False,
    walk: bool = True,
) -> Any:
    """Parse the JSON bytes `raw` of `file`; CheckpointError naming `file` for anything that is not clean JSON.

    `what` starts each message (e.g. "header " for a safetensors header; the default names the file itself).
    `unique_keys`: a key repeated in one object is an error (a repeated top-level name is the error's `tensor`).
    `reference`: refuse what serde_json refuses and Python accepts (see the module docstring); -0 is returned as
    the float -0.0 so that integer checks refuse it as the reference does.
    `walk`: check the nesting depth of the whole value (False: the caller checks where nesting can hide, e.g. a
    safetensors header, whose ~20k entries would cost as much to walk as to parse; lone surrogates are still
    refused, walking only when the text holds a surrogate escape).
    Bounded work: nesting is capped by the parser's recursion check, numbers by Python's 4300-digit limit.
    """
    fix = "re-download the file (or re-export it)"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{what}is not valid UTF-8 (byte {e.start}); {fix}", file=file) from None
    hooks: dict[str, Any] = {}
    repeated: list[tuple[str, dict]] = []  # (key, the object that holds it twice)
    if unique_keys:

        def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            # json.loads would silently keep the last of two equal keys: two tensors (or two shards for one
            # tensor) under one name is a broken file, not something to guess about.
            out: dict[str, Any] = {}
            for key, item in pairs:
                if key in out:
                    repeated.append((key, out))
                out[key] = item
            return out

        hooks["object_pairs_hook"] = unique_pairs
    if reference:
        hooks.update(parse_constant=_no_constant, parse_float=_finite_float)
        if _NEGATIVE_ZERO.search(text):  # rare: pay for the per-integer hook only when it can matter
            hooks["parse_int"] = _int_not_negative_zero
    try:
        value = json.loads(text, **hooks)
    except _Refused as e:
        raise CheckpointError(f"{what}{e.reason}; {fix}", file=file) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{what}is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); {fix}", file=file
        ) from None
    except RecursionError:
        raise CheckpointError(f"{what}is nested more than {MAX_DEPTH} levels deep; {fix}", file=file) from None
    except ValueError as e:  # int() past sys.get_int_max_str_digits() (4300 by default)
        raise CheckpointError(f"{what}holds a number too long to read ({e}); {fix}", file=file) from None
    if repeated:
        key, holder = repeated[0]
        if holder is value:  # a top-level name: in a safetensors header, a tensor
            raise CheckpointError(f"{what}lists the name twice; {fix}", file=file, tensor=key)
        raise CheckpointError(f"{what}lists the key {key!r} twice in one object; {fix}", file=file)
    surrogates = bool(_SURROGATE_ESCAPE.search(text))
    if walk or surrogates:
        check_value(value, file, what=what, surrogates=surrogates, max_depth=MAX_DEPTH if walk else None)
    return value


def check_value(
    value: Any,
    file: str,
    *,
    what: str = "",
    surrogates: bool = True,
    depth: int = 1,
    max_depth: int | None = MAX_DEPTH,
) -> None:
    """Refuse nesting deeper than `max_depth` (None: no limit), counting `value` as level `depth`, and, with
    `surrogates`, any key or string holding a lone UTF-16 surrogate. Iterative: a hostile value cannot exhaust
    the stack here."""
    fix = "re-download the file (or re-export it)"
    if not isinstance(value, (dict, list, str)):
        return
    stack: list[tuple[Any, int]] = [(value, depth)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, str):
            if surrogates and not _encodable(node):
                raise CheckpointError(
                    f"{what}holds a string with a lone UTF-16 surrogate ({ascii(node[:40])}), which is not valid "
                    f"Unicode; {fix}",
                    file=file,
                )
            continue
        if max_depth is not None and level > max_depth:
            raise CheckpointError(f"{what}is nested more than {max_depth} levels deep; {fix}", file=file)
        if isinstance(node, dict):
            if surrogates:
                stack.extend((k, level) for k in node)
            children = node.values()
        else:
            children = node
        for child in children:
            if isinstance(child, (dict, list)) or (surrogates and isinstance(child, str)):
                stack.append((child, level + 1))


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """Open `path` for reading in binary; CheckpointError naming it unless it is a regular file (after symlinks).

    Opened non-blocking and checked before any read: a FIFO (or a device) put where a checkpoint file belongs would
    otherwise block forever or read without end. OSError (missing, permissions) is left to the caller.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, socket or device)"
            raise CheckpointError(f"is {kind}; a checkpoint file must be a regular file", file=str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_json(path: Path, *, unique_keys: bool = False) -> dict[str, Any]:
    """Read the JSON object in `path` (a checkpoint side file: config.json, the shard index, ...).

    CheckpointError naming the file when it is missing (with where to get it), unreadable, bigger than
    MAX_FILE_BYTES, not clean JSON (see `loads`), or not a JSON object.
    """
    file = str(path)
    try:
        with open_regular(path) as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointError(
            f"not found; a model folder needs {path.name} (copy it from the model's hub page)", file=file
        ) from None
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror or e}", file=file) from None
    if len(raw) > MAX_FILE_BYTES:
        raise CheckpointError(
            f"is larger than {MAX_FILE_BYTES} bytes, far more than any {path.name}; replace it with the original",
            file=file,
        )
    data = loads(raw, file, unique_keys=unique_keys)
    if not isinstance(data, dict):
        raise CheckpointError(f"expected a JSON object, got {type(data).__name__}", file=file)
    return data
