"""The budget of one chat template rendering (`Limits`) and the sizes it meters: template.py renders with it.

`Limits.for_input(inputs, messages)` sizes a rendering's budget from what it was given; `size` bounds any one value
and the output, `work` the bytes of values made in all, `steps` loop iterations and calls. The helpers below size a
value's text and bound what str.format, `%`, the str methods and iteration may make before they run.
"""

from __future__ import annotations

import contextvars
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jinja2

# The budget of one rendering grows with its input (message texts, tools, ...), so a long conversation fits while a
# template can only spend a bounded multiple of what it was given. Measured on 71 real templates (llama.cpp's
# models/templates) with 3 and 1,001 messages: the hungriest used 249 MB of work for 1,001 messages (Reka-Edge adds
# each message to a string: quadratic), 515K steps (gemma-4: 4.7 s in plain jinja), output ~1.1x the input.
SIZE_FLOOR = 2**20  # characters or items of any one value (and of the output), whatever the input
SIZE_PER_INPUT = 4  # ... plus this many per character of input
WORK_FLOOR = 2**28  # bytes of values made in all: bounds both the time spent copying and the memory held
WORK_PER_INPUT = 64  # ... plus this many per character of input
STEPS_FLOOR = 2**19  # loop iterations and calls (1-4 s of Python at worst)
STEPS_PER_INPUT = 1  # ... plus this many per character of input
MACRO_STEPS = 8  # a macro call costs as much as ~8 loop iterations (measured: 18 vs 2 us)
INPUT_PER_MESSAGE = 256  # characters of input a message counts for, beside its text (templates wrap each)
INT_BITS = 2**16  # largest integer a template may make (Python cannot print one over 4,300 digits anyway)


class TemplateLimitError(Exception):
    """A rendering went over one of its limits (the message says which and by how much)."""


@dataclass
class Limits:
    """What one rendering may spend, and what it has spent."""

    size: int  # characters or items of one value
    work: int  # bytes made, and container elements walked, in all
    steps: int  # loop iterations and calls
    made: int = 0
    taken: int = 0

    @classmethod
    def for_input(cls, inputs: object, messages: int) -> Limits:
        """The limits of a rendering of `inputs` (the template's variables), which hold `messages` messages."""
        scale = text_size(inputs, 2**62)[0] + INPUT_PER_MESSAGE * messages
        return cls(size=SIZE_FLOOR + SIZE_PER_INPUT * scale, work=WORK_FLOOR + WORK_PER_INPUT * scale,
                   steps=STEPS_FLOOR + STEPS_PER_INPUT * scale)

    def bound(self, n: int, what: str) -> None:
        """`what` is about to make a value of at most `n` characters or items."""
        if n > self.size:
            raise TemplateLimitError(f"{what} makes {n:,} characters or items, over the limit of {self.size:,} "
                                     "for this conversation")

    def made_value(self, value: Any, what: str) -> Any:
        """Check and count a value `what` just made; hand it on."""
        if isinstance(value, (str, bytes)):
            self.bound(len(value), what)
            self.charge(sys.getsizeof(value))
        elif isinstance(value, (list, tuple, dict, set, frozenset)):
            self.bound(len(value), what)
            self.charge(64 + 8 * len(value))
        elif isinstance(value, int):
            self.bits(value.bit_length(), what)
        return value

    def charge(self, n: int) -> None:
        self.made += n
        if self.made > self.work:
            raise TemplateLimitError(f"it makes more than {self.work:,} bytes of values in all, the limit for this "
                                     "conversation")

    def step(self, n: int = 1) -> None:
        self.taken += n
        if self.taken > self.steps:
            raise TemplateLimitError(f"it runs more than {self.steps:,} loop iterations and calls, the limit for "
                                     "this conversation")

    def bits(self, n: float, what: str) -> None:
        if n > INT_BITS:
            raise TemplateLimitError(f"{what} makes a number of about {int(n):,} bits, over the limit of {INT_BITS:,}")


_LIMITS: contextvars.ContextVar[Limits] = contextvars.ContextVar("sluice_template_limits")


def use_limits(limits: Limits) -> contextvars.Token:
    """Make `limits` the current rendering's (render() resets the token when it ends)."""
    return _LIMITS.set(limits)


def reset_limits(token: contextvars.Token) -> None:
    _LIMITS.reset(token)


def current_limits() -> Limits:
    return _LIMITS.get()


def text_size(value: object, limit: int) -> tuple[int, int, int]:
    """(an upper bound of len(str(value)), its nesting depth, its number of elements), walking nested containers;
    TemplateLimitError as soon as the bound passes `limit`, so the walk costs at most O(limit)."""
    total = depth = elements = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v) + 3  # quotes, and the `b` of bytes
        elif isinstance(v, (list, tuple, set, frozenset, dict)):
            n = len(v)
            total += 2 + (4 if isinstance(v, dict) else 2) * n  # brackets, separators
            if total > limit:
                break
            elements += n
            depth = max(depth, d + 1)
            stack.extend((x, d + 1) for x in v)
            if isinstance(v, dict):
                stack.extend((x, d + 1) for x in v.values())
        elif v is None or isinstance(v, (bool, float)):
            total += 24
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 2  # decimal digits <= bits * 0.302
        elif isinstance(v, jinja2.utils.Namespace):
            stack.append((object.__getattribute__(v, "_Namespace__attrs"), d))
            total += 12
        elif not isinstance(v, jinja2.Undefined):
            total += 64  # range(...), a macro, a loop: a short repr
        if total > limit:
            break
    if total > limit:
        raise TemplateLimitError(f"a value's text is over the limit of {limit:,} characters for this conversation")
    return total, depth, elements


def sized_len(v: object) -> int | None:
    return len(v) if isinstance(v, (str, bytes, list, tuple, dict, set, frozenset)) else None


def made(value: Any, what: str) -> Any:
    return current_limits().made_value(value, what)


# ---- size bounds of the operations that multiply sizes -------------------------------------------------------------

_DIGITS = re.compile(r"\d+")


def as_int(v: object) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def format_bound(fmt: str, args: tuple, kwargs: Mapping, percent: bool) -> int:
    """Upper bound of `fmt % args` / `fmt.format(*args, **kwargs)`: each field holds at most all the arguments'
    text, padded to the widest width written in the format or passed as an argument (`%*s`, `{:{w}}`)."""
    lim = current_limits()
    args_size = text_size((args, kwargs), lim.size)[0]
    widths = [int(r) if len(r) < 12 else 10**12 for r in _DIGITS.findall(fmt)]
    if ("*" in fmt) if percent else ("{" in fmt):
        widths += [as_int(a) for a in (*args, *kwargs.values())]
    return len(fmt) + fmt.count("%" if percent else "{") * (max(widths, default=0) + args_size)


def percent_args(right: Any) -> tuple[tuple, Mapping]:
    """`fmt % right` as (args, kwargs)."""
    if isinstance(right, tuple):
        return right, {}
    return ((), right) if isinstance(right, Mapping) else ((right,), {})


def str_method_bound(obj: Any, args: tuple, kwargs: dict) -> tuple[int, tuple]:
    """(upper bound of the result's length, args) for a call of a method of a str / bytes that can make a value
    much longer than its inputs; (0, args) for the others. join's iterable is made a list first, to be sized."""
    inner = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format / format_map
    s = getattr(inner, "__self__", None)
    if not isinstance(s, (str, bytes)):
        return 0, args
    name = inner.__name__
    a = list(args)

    def arg(i: int, key: str, default: Any) -> Any:
        return a[i] if len(a) > i else kwargs.get(key, default)

    n = len(s)
    if name in ("ljust", "rjust", "center", "zfill"):
        return max(n, as_int(arg(0, "width", 0))), args
    if name == "expandtabs":
        return n + s.count("\t" if isinstance(s, str) else b"\t") * max(as_int(arg(0, "tabsize", 8)), 0), args
    if name == "replace":
        old, new, count = arg(0, "old", ""), arg(1, "new", ""), as_int(arg(2, "count", -1))
        if not (isinstance(old, type(s)) and isinstance(new, type(s))):
            return 0, args  # a TypeError when it runs
        hits = s.count(old) if old else n + 1
        hits = hits if count < 0 else min(hits, count)
        return n + hits * max(len(new) - len(old), 0), args
    if name == "join" and a:
        items = a[0] if isinstance(a[0], (list, tuple)) else list(metered_iter(a[0]))
        a[0] = items
        parts = sum(len(x) if isinstance(x, (str, bytes)) else 0 for x in items)
        return parts + n * len(items), tuple(a)
    if name in ("format", "format_map"):
        mapping = a[0] if name == "format_map" and a and isinstance(a[0], Mapping) else kwargs
        return format_bound(s, args, mapping, percent=False), args
    if name == "translate" and a and isinstance(a[0], Mapping):
        longest = max((len(v) for v in a[0].values() if isinstance(v, (str, bytes))), default=1)
        return n * max(longest, 1), args
    if name == "encode":
        return 4 * n, args
    return 0, args


def metered_iter(iterable: Iterable) -> Iterator:
    lim = current_limits()
    for item in iterable:
        lim.step()
        yield item


# ---- the environment ------------------------------------------------------------------------------------------------
