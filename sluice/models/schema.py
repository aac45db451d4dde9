"""config.json validation: each field the math reads is declared once, with its JSON type and accepted range, on the
dataclass that reads it; `parse` checks them all and names the field, the file and what is accepted.

Declaring fields (an architecture's `ModelArgs`, `RopeArgs` for the rope dict, `GenerationArgs`):

    hidden_size: int = cfg(ge=1)                               # required: an integer from 1 to MAX_INT
    head_dim: int | None = cfg(None, ge=1)                     # optional; JSON null allowed because the type says so
    num_experts: int = cfg(ge=1, aliases=("num_local_experts",))      # other spellings of the key
    num_experts_per_tok: int = cfg(ge=1, le="num_experts")     # a bound naming another field
    num_key_value_heads: int | None = cfg(None, ge=1, divides="num_attention_heads")
    mlp_only_layers: list[int] | None = cfg(None, ge=0, lt="num_hidden_layers")    # bounds apply per element
    layer_types: list[str] | None = cfg(None, choices=(...), length="num_hidden_layers")
    tie_word_embeddings: bool = cfg(False)                     # true/false only: never "false", 0 or null

The annotation is the accepted JSON type: `int` takes integers only (not 4096.0 nor "4096", as transformers>=5
refuses them too), and every integer is capped at MAX_INT unless the field sets its own `le`; `float` takes any finite number (an integer too: JSON
writers print 10000.0 as 10000); `bool` takes true/false; `str`, `dict`; `list[X]` checks each element; `| None`
allows null. Parsing runs in three passes: (1) presence, type and constant bounds of each field, on the raw JSON
values; (2) the dataclass is built (its `__post_init__` derives defaults, e.g. num_key_value_heads null -> heads),
then bounds naming other fields, `divides` and `length` are checked on the derived values; (3) the dataclass's
`config_problems()` yields relations a bound cannot state (a field required only when another is set, ...).
Keys a dataclass does not declare are ignored (mlx-lm style), so config.json may carry anything else.
`override(Base, name, default)` changes an inherited field's default and keeps its rule; `describe_fields(cls)`
lists every field with its accepted values.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import MISSING
from typing import Any, TypeVar

from ..errors import ConfigError

T = TypeVar("T")

#: the largest integer any size, count or id may take unless its field says less: GGUF stores these fields as
#: u32/i32, and every real config is orders of magnitude below it; it also keeps products of sizes far from int64
#: overflow. Fields that size something built before the checkpoint's shapes are checked (per-layer lists, the
#: rope frequencies) have tighter bounds of their own.
MAX_INT = 2**31 - 1

_RULE = "sluice.config_rule"


@dataclasses.dataclass(frozen=True)
class Rule:
    """Range of one config field. Numeric bounds (ge/gt/le/lt) and `choices` apply to each element of a list;
    a bound given as a string names another field of the same dataclass (checked after derivation)."""

    ge: float | str | None = None
    gt: float | str | None = None
    le: float | str | None = None
    lt: float | str | None = None
    choices: tuple[str, ...] | None = None
    divides: str | None = None  # the value must divide this other field
    length: str | None = None  # a list whose length equals this other field
    aliases: tuple[str, ...] = ()  # other spellings of the key (transformers' attribute_map)


def cfg(
    default: Any = MISSING,
    *,
    ge: float | str | None = None,
    gt: float | str | None = None,
    le: float | str | None = None,
    lt: float | str | None = None,
    choices: tuple[str, ...] | None = None,
    divides: str | None = None,
    length: str | None = None,
    aliases: tuple[str, ...] = (),
) -> Any:
    """A dataclass field read from config.json; no `default` makes it required. See the module docstring."""
    rule = Rule(ge, gt, le, lt, tuple(choices) if choices else None, divides, length, tuple(aliases))
    return _field(default, rule)


def override(base: type, name: str, default: Any) -> Any:
    """`base`'s config field `name` with another default and the same rule (an architecture's own default)."""
    return _field(default, _rules(base)[name][1])


def _field(default: Any, rule: Rule) -> Any:
    meta = {_RULE: rule}
    if default is MISSING:
        return dataclasses.field(metadata=meta)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@functools.cache  # get_type_hints evaluates every annotation string: ~2 ms a call
def _rules(cls: type) -> dict[str, tuple[Any, Rule, dataclasses.Field]]:
    """name -> (resolved annotation, Rule, Field) for every config field of dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: (hints[f.name], f.metadata[_RULE], f)
        for f in dataclasses.fields(cls)
        if _RULE in f.metadata
    }


# -- types -------------------------------------------------------------------------------------------------------

_NOUNS = {int: ("an integer", "integers"), float: ("a number", "numbers"), bool: ("true or false", "booleans"),
          str: ("a string", "strings"), dict: ("an object", "objects"), type(None): ("null", "nulls")}


def _union_args(tp: Any) -> tuple[Any, ...] | None:
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else None


def _finite(x: int | float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


def _accepts(tp: Any, value: Any) -> bool:
    """Whether JSON `value` is of declared type `tp` (strictly: bool is not an int, 4096.0 is not an int)."""
    if (args := _union_args(tp)) is not None:
        return any(_accepts(a, value) for a in args)
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_accepts(item, v) for v in value)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value)
    if tp in (str, dict):
        return isinstance(value, tp)
    raise TypeError(f"config schema: unsupported field type {tp!r}")


def _describe(tp: Any) -> str:
    """'an integer or null', 'a list of integers', ... for the accepted-values part of a message."""
    if (args := _union_args(tp)) is not None:
        return " or ".join(_describe(a) for a in sorted(args, key=lambda a: a is type(None)))
    if typing.get_origin(tp) is list:
        return f"a list of {_NOUNS[typing.get_args(tp)[0]][1]}"
    return _NOUNS[tp][0]


@functools.cache
def _has_int(tp: Any) -> bool:
    """Whether the field holds integers (which get the MAX_INT cap; floats have no cap)."""
    if (args := _union_args(tp)) is not None:
        return any(_has_int(a) for a in args)
    if typing.get_origin(tp) is list:
        return _has_int(typing.get_args(tp)[0])
    return tp is int


def _normalize(tp: Any, value: Any) -> Any:
    """Ints in float fields become floats, so the math downstream sees one type; lists are copied."""
    if float in (_union_args(tp) or (tp,)) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, list):
        return list(value)
    return value


def show(value: Any) -> str:
    """`value` as a short JSON-ish text for a message: safe for huge ints, long strings and deep nesting."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, float):
        return json.dumps(value)  # NaN / Infinity spelled as JSON would
    if isinstance(value, str):
        return json.dumps(value if len(value) <= 40 else value[:40] + "...")
    if isinstance(value, (list, dict)):
        items = list(value.values()) if isinstance(value, dict) else value
        if len(value) <= 6 and all(v is None or isinstance(v, (bool, int, float, str)) for v in items):
            if isinstance(value, list):
                return "[" + ", ".join(show(v) for v in value) + "]"
            return "{" + ", ".join(f"{show(k)}: {show(v)}" for k, v in value.items()) + "}"
        return f"a list of {len(value)} items" if isinstance(value, list) else f"an object of {len(value)} keys"
    return type(value).__name__


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    for t in (bool, int, float, str, list, dict):
        if isinstance(value, t):
            return {list: "a list", dict: "an object"}.get(t) or _NOUNS[t][0]
    return type(value).__name__


def _hint(tp: Any, value: Any) -> str:
    """How to write a value of the right type, where a near miss is likely (4096.0 for an integer)."""
    if isinstance(value, float) and _finite(value) and value.is_integer() and _has_int(tp):
        return f"; write {int(value)}, without the decimal point"
    return ""


# -- bounds ------------------------------------------------------------------------------------------------------

_OPS = {"ge": (">=", lambda a, b: a >= b), "gt": (">", lambda a, b: a > b),
        "le": ("<=", lambda a, b: a <= b), "lt": ("<", lambda a, b: a < b)}


def _bounds(tp: Any, rule: Rule, resolve) -> list[tuple[str, Any, str | None]]:
    """(op, bound value, the field it comes from or None) for each bound of `rule`; `resolve(name)` -> another
    field's value, or MISSING to leave bounds naming fields out (pass 1). Int fields get the MAX_INT cap."""
    out = []
    for op in ("ge", "gt", "le", "lt"):
        b = getattr(rule, op)
        if isinstance(b, str):
            v = resolve(b)
            if v is not MISSING and v is not None:
                out.append((op, v, b))
        elif b is not None:
            out.append((op, b, None))
    if rule.le is None and rule.lt is None and _has_int(tp):
        out.append(("le", MAX_INT, None))
    return out


def _expected(tp: Any, rule: Rule, resolve) -> str:
    """The accepted values of a field in words: 'an integer from 1 to num_experts (8)'."""
    alts = _union_args(tp) or (tp,)
    core = [a for a in alts if a is not type(None)]
    is_list = any(typing.get_origin(a) is list for a in core)
    each = ", each " if is_list else " "
    text = " or ".join(_describe(a) for a in core)
    if rule.choices:
        choices = "one of " + ", ".join(json.dumps(c) for c in rule.choices)
        text = f"{text}{each}{choices}" if is_list else choices
    bounds = [(op, show(v) if src is None else f"{src} ({show(v)})") for op, v, src in _bounds(tp, rule, resolve)]
    if bounds:
        lo = [(op, t) for op, t in bounds if op in ("ge", "gt")]
        hi = [(op, t) for op, t in bounds if op in ("le", "lt")]
        if len(lo) == 1 and len(hi) == 1 and lo[0][0] == "ge" and hi[0][0] == "le":
            parts = [f"from {lo[0][1]} to {hi[0][1]}"]
        else:
            parts = [f"{_OPS[op][0]} {t}" for op, t in lo + hi]
        text += each + " and ".join(parts)
    if rule.divides and (d := resolve(rule.divides)) not in (MISSING, None):
        text += f" that divides {rule.divides} ({show(d)})"
    if rule.length and (n := resolve(rule.length)) not in (MISSING, None):
        text += f", of length {rule.length} ({show(n)})"
    if len(core) < len(alts):
        text += " (or null)"
    return text


def _elements(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _breaks(tp: Any, rule: Rule, value: Any, resolve) -> bool:
    """Whether `value` (already of the right type) is outside the rule's range."""
    bounds = _bounds(tp, rule, resolve)
    for v in _elements(value):
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, (int, float)) and not all(_OPS[op][1](v, b) for op, b, _ in bounds):
            return True
        if isinstance(v, str) and rule.choices and v not in rule.choices:
            return True
    if rule.divides and value is not None:
        d = resolve(rule.divides)
        if d is not MISSING and d is not None and d % value:
            return True
    if rule.length and value is not None:
        n = resolve(rule.length)
        if n is not MISSING and n is not None and len(value) != n:
            return True
    return False


# -- parsing -----------------------------------------------------------------------------------------------------


def _key(name: str, rule: Rule, values: Mapping[str, Any], source: str, prefix: str) -> str | None:
    """The key `values` spells field `name` with (itself or an alias), None when absent. Two spellings with
    different values are ambiguous (which one transformers keeps depends on its version): an error."""
    present = [k for k in (name, *rule.aliases) if k in values]
    for k in present[1:]:
        if values[k] != values[present[0]]:
            raise ConfigError(
                f"{show(values[present[0]])}, but {prefix}{k} (another spelling of the same field) is "
                f"{show(values[k])}; keep one of them", file=source, field=prefix + present[0],
            )
    return present[0] if present else None


def parse(
    cls: type[T], values: Any, *, source: str, prefix: str = "", extra: Mapping[str, Any] | None = None
) -> T:
    """Build dataclass `cls` from the JSON object `values` after checking every config field it declares.

    `source`: the file the values came from (named in errors); `prefix`: the dotted path of a nested object
    (`rope_parameters.`); `extra`: init arguments that are not config fields. Raises ConfigError naming the file,
    the field (as config.json spells it) and the accepted values; unknown keys are ignored.
    """
    if not isinstance(values, Mapping):
        raise ConfigError(f"got {_kind(values)}; expected a JSON object", file=source, field=prefix.rstrip(".") or None)
    rules = _rules(cls)
    kwargs: dict[str, Any] = {}
    shown: dict[str, str] = {}  # field -> the key config.json uses for it, with the prefix
    for name, (tp, rule, f) in rules.items():
        key = _key(name, rule, values, source, prefix)
        shown[name] = prefix + (key or name)
        required = f.default is MISSING and f.default_factory is MISSING
        if key is None:
            if required:
                expected = _expected(tp, rule, lambda _: MISSING)
                raise ConfigError(f"missing; expected {expected}", file=source, field=shown[name])
            continue
        value = values[key]
        if not _accepts(tp, value) or _breaks(tp, rule, value, lambda _: MISSING):
            got = f"got {show(value)}" + ("" if _accepts(tp, value) else f" ({_kind(value)}{_hint(tp, value)})")
            raise ConfigError(f"{got}; expected {_expected(tp, rule, lambda _: MISSING)}", file=source,
                              field=shown[name])
        kwargs[name] = _normalize(tp, value)

    obj = cls(**kwargs, **(extra or {}))

    def resolve(other: str) -> Any:
        return getattr(obj, other, MISSING)

    for name, (tp, rule, _) in rules.items():
        value = getattr(obj, name)
        if _breaks(tp, rule, value, resolve):
            got = f"got {show(value)}" if name in kwargs and kwargs[name] is not None else (
                f"{show(value)} derived from other fields (the file gives no {shown[name]})")
            raise ConfigError(f"{got}; expected {_expected(tp, rule, resolve)}", file=source, field=shown[name])
    problems = getattr(obj, "config_problems", None)
    for field_name, message in problems() if problems else ():
        raise ConfigError(message, file=source, field=shown.get(field_name, prefix + field_name))
    return obj


def describe_fields(cls: type) -> Iterator[tuple[str, str, bool, Any]]:
    """(key, accepted values, required, default) for each config field of `cls`: documentation and tests."""
    for name, (tp, rule, f) in _rules(cls).items():
        required = f.default is MISSING and f.default_factory is MISSING
        default = None if required else (f.default if f.default is not MISSING else f.default_factory())
        yield name, _expected(tp, rule, lambda other: MISSING), required, default
