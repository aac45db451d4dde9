"""Chat templates: jinja2 in the sandbox transformers renders them in, with a bound on what one rendering may cost.

A chat template comes with the model (GGUF metadata, tokenizer_config.json, chat_template.jinja) or from the caller,
and it is a program. jinja's sandbox stops attribute escapes and ranges over 100,000 items, not the rest:
`{{ 'x' * 300000000 }}` takes 300 MB at once, two nested loops over range(100000) run for hours, and a value
doubled in a loop (`~`, `+`) or a macro calling itself twice per level grows exponentially. So each rendering gets
a budget, `Limits`, sized from its input:
- `size`: no value it makes (a string, a list, the output) may hold more characters or items. The operations that
  multiply sizes (`*`, `**`, `%`, str.format, ljust / center / replace / join / translate, the filters that pad,
  repeat or indent) are checked BEFORE they run; the others make at most about the sum of their inputs and are
  checked after. Text made from a nested value (output, `~`, tojson, join, string) is sized by walking the value:
  shared references make its text far larger than its length (a list of a list of ... twice the same string).
- `work`: the bytes of the values made, summed (the text of loop and macro bodies each time they run included):
  this bounds both the time spent copying and the memory a rendering can hold.
- `steps`: loop iterations and calls.
After parsing, the template's syntax tree is rewritten so loops, `~`, comparisons and macro bodies go through the
meters below; exceeding a limit raises `TemplateLimitError`, which the tokenizer reports naming the template.
"""

from __future__ import annotations

import contextvars
import functools
import json
import math
import re
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes as nodes
import jinja2.runtime
import jinja2.utils
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg
from jinja2.visitor import NodeTransformer

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


def _limits() -> Limits:
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


def _sized_len(v: object) -> int | None:
    return len(v) if isinstance(v, (str, bytes, list, tuple, dict, set, frozenset)) else None


def _made(value: Any, what: str) -> Any:
    return _limits().made_value(value, what)


# ---- size bounds of the operations that multiply sizes -------------------------------------------------------------

_DIGITS = re.compile(r"\d+")


def _int(v: object) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _format_bound(fmt: str, args: tuple, kwargs: Mapping, percent: bool) -> int:
    """Upper bound of `fmt % args` / `fmt.format(*args, **kwargs)`: each field holds at most all the arguments'
    text, padded to the widest width written in the format or passed as an argument (`%*s`, `{:{w}}`)."""
    lim = _limits()
    args_size = text_size((args, kwargs), lim.size)[0]
    widths = [int(r) if len(r) < 12 else 10**12 for r in _DIGITS.findall(fmt)]
    if ("*" in fmt) if percent else ("{" in fmt):
        widths += [_int(a) for a in (*args, *kwargs.values())]
    return len(fmt) + fmt.count("%" if percent else "{") * (max(widths, default=0) + args_size)


def _percent_args(right: Any) -> tuple[tuple, Mapping]:
    """`fmt % right` as (args, kwargs)."""
    if isinstance(right, tuple):
        return right, {}
    return ((), right) if isinstance(right, Mapping) else ((right,), {})


def _str_method_bound(obj: Any, args: tuple, kwargs: dict) -> tuple[int, tuple]:
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
        return max(n, _int(arg(0, "width", 0))), args
    if name == "expandtabs":
        return n + s.count("\t" if isinstance(s, str) else b"\t") * max(_int(arg(0, "tabsize", 8)), 0), args
    if name == "replace":
        old, new, count = arg(0, "old", ""), arg(1, "new", ""), _int(arg(2, "count", -1))
        if not (isinstance(old, type(s)) and isinstance(new, type(s))):
            return 0, args  # a TypeError when it runs
        hits = s.count(old) if old else n + 1
        hits = hits if count < 0 else min(hits, count)
        return n + hits * max(len(new) - len(old), 0), args
    if name == "join" and a:
        items = a[0] if isinstance(a[0], (list, tuple)) else list(_metered_iter(a[0]))
        a[0] = items
        parts = sum(len(x) if isinstance(x, (str, bytes)) else 0 for x in items)
        return parts + n * len(items), tuple(a)
    if name in ("format", "format_map"):
        mapping = a[0] if name == "format_map" and a and isinstance(a[0], Mapping) else kwargs
        return _format_bound(s, args, mapping, percent=False), args
    if name == "translate" and a and isinstance(a[0], Mapping):
        longest = max((len(v) for v in a[0].values() if isinstance(v, (str, bytes))), default=1)
        return n * max(longest, 1), args
    if name == "encode":
        return 4 * n, args
    return 0, args


def _metered_iter(iterable: Iterable) -> Iterator:
    lim = _limits()
    for item in iterable:
        lim.step()
        yield item


# ---- the environment ------------------------------------------------------------------------------------------------


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox (immutable: no list.append in templates) whose calls, operators, loops, `~`,
    comparisons, filters and output are metered against the `Limits` of the rendering in progress."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **kwargs: Any):
        super().__init__(finalize=self.sluice_output, **kwargs)
        self.filters = {name: _metered_filter(name, f) for name, f in self.filters.items()}
        self.tests = {name: _metered_test(name, t) for name, t in self.tests.items()}
        self.globals["lipsum"] = _lipsum(self.globals["lipsum"])

    # -- what the sandbox lets us intercept
    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        lim, what = _limits(), f"'{operator}'"
        if operator == "*":
            if isinstance(left, int) and isinstance(right, int):
                lim.bits(left.bit_length() + right.bit_length(), what)
            else:
                seq, times = (left, right) if isinstance(right, int) else (right, left)
                n = _sized_len(seq)
                if n is not None and isinstance(times, int):
                    lim.bound(n * max(times, 0), what)
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            lim.bits(right * math.log2(abs(left)), what)
        elif operator == "+":
            n, m = _sized_len(left), _sized_len(right)
            if n is not None and m is not None:
                lim.bound(n + m, what)
        elif operator == "%" and isinstance(left, str):
            lim.bound(_format_bound(left, *_percent_args(right), percent=True), what)
        return lim.made_value(super().call_binop(context, operator, left, right), what)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's names)
        if isinstance(__obj, types.MethodType) and __obj.__self__ is __self and __obj.__func__ in _METERS:
            kwargs.pop("_loop_vars", None), kwargs.pop("_block_vars", None)  # (what jinja hands macros)
            return __obj(*args, **kwargs)  # a meter the rewrite put in: not a step of the template's own
        lim = _limits()
        lim.step(MACRO_STEPS if isinstance(__obj, jinja2.runtime.Macro) else 1)
        if isinstance(__obj, LoopContext) and args:  # `loop(children)` of a recursive loop: iterations are steps
            args = (_metered_iter(args[0]),) + args[1:]
        big = max((_int(a) for a in (*args, *kwargs.values())), default=0)
        if big > lim.size and isinstance(__obj, types.BuiltinMethodType):  # a width, a count: ljust, to_bytes, ...
            raise TemplateLimitError(f"{__obj.__name__}() with the number {big:,} is over the limit of {lim.size:,} "
                                     "characters or items for this conversation")
        bound, args = _str_method_bound(__obj, args, kwargs)
        name = getattr(__obj, "__name__", type(__obj).__name__)
        if bound:
            lim.bound(bound, f"{name}()")
        return _made(super().call(__context, __obj, *args, **kwargs), f"{name}()")

    def getitem(self, obj: Any, argument: Any) -> Any:
        value = super().getitem(obj, argument)
        return _made(value, "a slice") if isinstance(argument, slice) else value

    # -- the meters the rewritten syntax tree calls (environment.sluice_*)
    def sluice_loop(self, iterable: Any) -> Iterator:
        """A `for` loop's iterable: each item is a step (the filtered-out ones too)."""
        return _metered_iter(iterable)

    def sluice_charge(self, weight: int) -> str:
        """First statement of a loop or macro body: the text it writes each time it runs."""
        _limits().charge(weight)
        return ""

    def sluice_concat(self, *parts: Any) -> str:
        """`a ~ b ~ ...`, sized before it is joined."""
        lim = _limits()
        n = sum(len(p) if isinstance(p, str) else text_size(p, lim.size)[0] for p in parts)
        lim.bound(n, "'~'")
        return lim.made_value("".join(map(str, parts)), "'~'")  # jinja's own str_join

    def sluice_sized(self, value: Any) -> Any:
        """An operand of a comparison: comparing costs up to its size (deeply: shared references)."""
        lim = _limits()
        lim.charge(len(value) if isinstance(value, str) else text_size(value, lim.size)[0])
        return value

    def sluice_output(self, value: Any) -> Any:
        """What `{{ ... }}` writes (jinja's `finalize`): its text is sized before it is made."""
        if isinstance(value, str):
            return value
        lim = _limits()
        lim.bound(text_size(value, lim.size)[0], "an output")
        return lim.made_value(str(value), "an output")

    def concat(self, pieces: Iterable[str]) -> str:  # type: ignore[override]
        """Joins what a macro, a `{% set %}` block or a filter block wrote (jinja's is "".join), sized first."""
        pieces = pieces if isinstance(pieces, list) else list(pieces)
        lim = _limits()
        lim.bound(sum(map(len, pieces)), "a block's output")
        return lim.made_value("".join(pieces), "a block's output")

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = _Meter().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree


_METERS = {BoundedEnvironment.sluice_loop, BoundedEnvironment.sluice_charge, BoundedEnvironment.sluice_concat,
           BoundedEnvironment.sluice_sized}


def _meter(name: str, *args: nodes.Expr, lineno: int) -> nodes.Call:
    call = nodes.Call(nodes.EnvironmentAttribute(name), list(args), [], None, None)
    return call.set_lineno(lineno)


def _text_weight(body: list[nodes.Node]) -> int:
    """Characters a body writes from its own text each time it runs (what its output nodes hold as constants)."""
    n = 1
    for node in body:
        for const in node.find_all((nodes.TemplateData, nodes.Const)):
            value = const.data if isinstance(const, nodes.TemplateData) else const.value
            n += len(value) if isinstance(value, str) else 0
    return n


class _Meter(NodeTransformer):
    """Routes loops, macro bodies, `~` and comparisons through the environment's meters."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = _meter("sluice_loop", node.iter, lineno=node.lineno)
        self._charge(node)
        return node

    def visit_Macro(self, node: nodes.Macro) -> nodes.Macro:
        node = self.generic_visit(node)
        self._charge(node)
        return node

    def visit_CallBlock(self, node: nodes.CallBlock) -> nodes.CallBlock:
        node = self.generic_visit(node)
        self._charge(node)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        node = self.generic_visit(node)
        return _meter("sluice_concat", *node.nodes, lineno=node.lineno)

    def visit_Compare(self, node: nodes.Compare) -> nodes.Compare:
        node = self.generic_visit(node)
        node.expr = _meter("sluice_sized", node.expr, lineno=node.lineno)
        for op in node.ops:
            op.expr = _meter("sluice_sized", op.expr, lineno=node.lineno)
        return node

    @staticmethod
    def _charge(node: nodes.For | nodes.Macro | nodes.CallBlock) -> None:
        weight = nodes.Const(_text_weight(node.body)).set_lineno(node.lineno)
        node.body.insert(0, nodes.ExprStmt(_meter("sluice_charge", weight, lineno=node.lineno), lineno=node.lineno))


# ---- filters and tests ----------------------------------------------------------------------------------------------

# Filters that never turn their input into text or compare its items: no need to walk a nested input.
_STRUCTURAL = {"length", "count", "first", "last", "list", "reverse", "map", "select", "reject", "selectattr",
               "rejectattr", "items", "batch", "slice", "random", "default", "d", "attr", "int", "float", "abs",
               "round", "safe", "wordcount", "filesizeformat", "bool"}
# Filters that can make far more than their input: sized before they run (_filter_bound).
_BOUNDED = {"center", "indent", "wordwrap", "replace", "format", "join", "batch", "slice", "tojson", "pprint",
            "urlize", "e", "escape", "forceescape", "xmlattr", "urlencode", "sum"}
_COMPARING_TESTS = {"in", "eq", "equalto", "==", "ne", "!=", "lt", "lessthan", "<", "le", "<=", "gt",
                    "greaterthan", ">", "ge", ">="}


def _filter_bound(name: str, v: Any, a: list, kw: dict, lim: Limits) -> int:
    """Upper bound of the size a filter that can multiply its input's size makes; 0 for the others."""

    if name not in _BOUNDED:
        return 0

    def arg(i: int, key: str, default: Any) -> Any:
        return a[i] if len(a) > i else kw.get(key, default)

    text = len(v) if isinstance(v, str) else text_size(v, lim.size)[0]
    if name == "center":
        return max(text, _int(arg(0, "width", 80)))
    if name == "indent":
        width = arg(0, "width", 4)
        width = _int(width) if not isinstance(width, str) else len(width)
        lines = (v.count("\n") if isinstance(v, str) else text) + 1
        return text + lines * width
    if name == "wordwrap":
        wrap = arg(2, "wrapstring", None)
        return (text + 1) * (1 + (len(wrap) if isinstance(wrap, str) else 1))
    if name == "replace":
        old, new, count = arg(0, "old", ""), arg(1, "new", ""), arg(2, "count", None)
        if not (isinstance(old, str) and isinstance(new, str)):
            return 0
        hits = v.count(old) if isinstance(v, str) and old else text + 1
        hits = hits if count is None else min(hits, max(_int(count), 0))
        return text + hits * max(len(new) - len(old), 0)
    if name == "format":
        return _format_bound(v, tuple(a), kw, percent=True) if isinstance(v, str) else 0
    if name == "join":
        d = arg(0, "d", "")
        return text + (len(d) if isinstance(d, str) else 0) * (_sized_len(v) or 0)
    if name in ("batch", "slice"):
        return (_sized_len(v) or 0) + _int(arg(0, "linecount" if name == "batch" else "slices", 0))
    if name in ("tojson", "pprint"):
        _, depth, elements = text_size(v, lim.size)
        indent = arg(1, "indent", None) if name == "tojson" else 1
        indent = len(indent) if isinstance(indent, str) else _int(indent)
        seps = arg(2, "separators", None) if name == "tojson" else None
        sep = sum(len(s) for s in seps if isinstance(s, str)) if isinstance(seps, (list, tuple)) else 2
        escaped = 6 if name == "tojson" and arg(0, "ensure_ascii", False) else 1  # \uXXXX per character
        return escaped * text + elements * (1 + sep + depth * indent)
    if name == "urlize":
        extra = sum(len(x) for x in (arg(2, "target", None), arg(3, "rel", None)) if isinstance(x, str))
        return (text + 1) * (12 + extra)
    if name in ("e", "escape", "forceescape", "xmlattr"):
        return 6 * text
    if name == "urlencode":
        return 3 * text
    if name == "sum" and isinstance(v, (list, tuple)):
        start = arg(1, "start", 0)
        return sum(_sized_len(x) or 0 for x in v) + (_sized_len(start) or 0)
    return 0


def _metered_filter(name: str, f: Callable) -> Callable:
    """A filter checked against the rendering's limits (the wrapper keeps jinja's pass_context marks)."""
    passes = _PassArg.from_obj(f) is not None

    @functools.wraps(f)
    def filt(*args: Any, **kwargs: Any) -> Any:
        lim = _limits()
        lead, (value, *rest) = (args[:1], args[1:]) if passes else ((), args)
        if name == "join" and not isinstance(value, (str, list, tuple, dict, set, frozenset)):
            value = list(_metered_iter(value))  # sized before it is joined
        if name not in _STRUCTURAL and isinstance(value, (list, tuple, dict, set, frozenset)):
            lim.charge(text_size(value, lim.size)[0])  # turned into text, or its items compared
        bound = _filter_bound(name, value, rest, kwargs, lim)
        if bound:
            lim.bound(bound, f"the filter {name!r}")
        return _made(f(*lead, value, *rest, **kwargs), f"the filter {name!r}")

    return filt


def _metered_test(name: str, t: Callable) -> Callable:
    if name not in _COMPARING_TESTS:
        return t

    @functools.wraps(t)
    def test(*args: Any, **kwargs: Any) -> Any:
        lim = _limits()
        lim.charge(text_size((args, kwargs), lim.size)[0])
        return t(*args, **kwargs)

    return test


def _lipsum(f: Callable) -> Callable:
    @functools.wraps(f)
    def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 (jinja's names)
        _limits().bound(_int(n) * _int(max) * 20, "lipsum()")  # words of at most ~15 characters, markup
        return f(n, html, min, max)

    return lipsum


# ---- what transformers adds to the environment -----------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; at inference it is a no-op."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    # `dict(...)` in templates without handing out the dict type itself.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Underscore attributes on a namespace are a known sandbox escape route; transformers refuses them too.
    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes `<>&'`; templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    _limits().bound(16 * len(fmt), "strftime_now()")  # `%c` (2 characters) writes 24
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                             extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _metered_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


def render(template: str, limits: Limits, **variables: Any) -> str:
    """The template's text for `variables`, within `limits`.

    Raises jinja2.TemplateSyntaxError (the template does not parse), TemplateLimitError, jinja2.TemplateError
    (raise_exception() in the template, a sandbox refusal) or whatever the template's own operations raise
    (TypeError, ZeroDivisionError, RecursionError, ...): the caller names the template in one message."""
    token = _LIMITS.set(limits)
    try:
        compiled = _compile(template)  # (constant parts are evaluated while compiling: metered too)
        out, n = [], 0
        for piece in compiled.generate(**variables):
            n += len(piece)
            if n > limits.size:
                raise TemplateLimitError(f"its output passes the limit of {limits.size:,} characters for this "
                                         "conversation")
            out.append(piece)
        return "".join(out)
    finally:
        _LIMITS.reset(token)


def error_line(e: BaseException) -> int | None:
    """The template line an error was raised at (jinja rewrites tracebacks to point at `<template>` lines)."""
    line, tb = None, e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line

