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

import functools
import json
import math
import types
from collections.abc import Callable, Iterable, Iterator
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

from .template_limits import (MACRO_STEPS, Limits, TemplateLimitError, as_int, current_limits, format_bound, made,
                              metered_iter, percent_args, reset_limits, sized_len, str_method_bound, text_size,
                              use_limits)

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
        lim, what = current_limits(), f"'{operator}'"
        if operator == "*":
            if isinstance(left, int) and isinstance(right, int):
                lim.bits(left.bit_length() + right.bit_length(), what)
            else:
                seq, times = (left, right) if isinstance(right, int) else (right, left)
                n = sized_len(seq)
                if n is not None and isinstance(times, int):
                    lim.bound(n * max(times, 0), what)
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            lim.bits(right * math.log2(abs(left)), what)
        elif operator == "+":
            n, m = sized_len(left), sized_len(right)
            if n is not None and m is not None:
                lim.bound(n + m, what)
        elif operator == "%" and isinstance(left, str):
            lim.bound(format_bound(left, *percent_args(right), percent=True), what)
        return lim.made_value(super().call_binop(context, operator, left, right), what)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's names)
        if isinstance(__obj, types.MethodType) and __obj.__self__ is __self and __obj.__func__ in _METERS:
            kwargs.pop("_loop_vars", None), kwargs.pop("_block_vars", None)  # (what jinja hands macros)
            return __obj(*args, **kwargs)  # a meter the rewrite put in: not a step of the template's own
        lim = current_limits()
        lim.step(MACRO_STEPS if isinstance(__obj, jinja2.runtime.Macro) else 1)
        if isinstance(__obj, LoopContext) and args:  # `loop(children)` of a recursive loop: iterations are steps
            args = (metered_iter(args[0]),) + args[1:]
        big = max((as_int(a) for a in (*args, *kwargs.values())), default=0)
        if big > lim.size and isinstance(__obj, types.BuiltinMethodType):  # a width, a count: ljust, to_bytes, ...
            raise TemplateLimitError(f"{__obj.__name__}() with the number {big:,} is over the limit of {lim.size:,} "
                                     "characters or items for this conversation")
        bound, args = str_method_bound(__obj, args, kwargs)
        name = getattr(__obj, "__name__", type(__obj).__name__)
        if bound:
            lim.bound(bound, f"{name}()")
        return made(super().call(__context, __obj, *args, **kwargs), f"{name}()")

    def getitem(self, obj: Any, argument: Any) -> Any:
        value = super().getitem(obj, argument)
        return made(value, "a slice") if isinstance(argument, slice) else value

    # -- the meters the rewritten syntax tree calls (environment.sluice_*)
    def sluice_loop(self, iterable: Any) -> Iterator:
        """A `for` loop's iterable: each item is a step (the filtered-out ones too)."""
        return metered_iter(iterable)

    def sluice_charge(self, weight: int) -> str:
        """First statement of a loop or macro body: the text it writes each time it runs."""
        current_limits().charge(weight)
        return ""

    def sluice_concat(self, *parts: Any) -> str:
        """`a ~ b ~ ...`, sized before it is joined."""
        lim = current_limits()
        n = sum(len(p) if isinstance(p, str) else text_size(p, lim.size)[0] for p in parts)
        lim.bound(n, "'~'")
        return lim.made_value("".join(map(str, parts)), "'~'")  # jinja's own str_join

    def sluice_sized(self, value: Any) -> Any:
        """An operand of a comparison: comparing costs up to its size (deeply: shared references)."""
        lim = current_limits()
        lim.charge(len(value) if isinstance(value, str) else text_size(value, lim.size)[0])
        return value

    def sluice_output(self, value: Any) -> Any:
        """What `{{ ... }}` writes (jinja's `finalize`): its text is sized before it is made."""
        if isinstance(value, str):
            return value
        lim = current_limits()
        lim.bound(text_size(value, lim.size)[0], "an output")
        return lim.made_value(str(value), "an output")

    def concat(self, pieces: Iterable[str]) -> str:  # type: ignore[override]
        """Joins what a macro, a `{% set %}` block or a filter block wrote (jinja's is "".join), sized first."""
        pieces = pieces if isinstance(pieces, list) else list(pieces)
        lim = current_limits()
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
        return max(text, as_int(arg(0, "width", 80)))
    if name == "indent":
        width = arg(0, "width", 4)
        width = as_int(width) if not isinstance(width, str) else len(width)
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
        hits = hits if count is None else min(hits, max(as_int(count), 0))
        return text + hits * max(len(new) - len(old), 0)
    if name == "format":
        return format_bound(v, tuple(a), kw, percent=True) if isinstance(v, str) else 0
    if name == "join":
        d = arg(0, "d", "")
        return text + (len(d) if isinstance(d, str) else 0) * (sized_len(v) or 0)
    if name in ("batch", "slice"):
        return (sized_len(v) or 0) + as_int(arg(0, "linecount" if name == "batch" else "slices", 0))
    if name in ("tojson", "pprint"):
        _, depth, elements = text_size(v, lim.size)
        indent = arg(1, "indent", None) if name == "tojson" else 1
        indent = len(indent) if isinstance(indent, str) else as_int(indent)
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
        return sum(sized_len(x) or 0 for x in v) + (sized_len(start) or 0)
    return 0


def _metered_filter(name: str, f: Callable) -> Callable:
    """A filter checked against the rendering's limits (the wrapper keeps jinja's pass_context marks)."""
    passes = _PassArg.from_obj(f) is not None

    @functools.wraps(f)
    def filt(*args: Any, **kwargs: Any) -> Any:
        lim = current_limits()
        lead, (value, *rest) = (args[:1], args[1:]) if passes else ((), args)
        if name == "join" and not isinstance(value, (str, list, tuple, dict, set, frozenset)):
            value = list(metered_iter(value))  # sized before it is joined
        if name not in _STRUCTURAL and isinstance(value, (list, tuple, dict, set, frozenset)):
            lim.charge(text_size(value, lim.size)[0])  # turned into text, or its items compared
        bound = _filter_bound(name, value, rest, kwargs, lim)
        if bound:
            lim.bound(bound, f"the filter {name!r}")
        return made(f(*lead, value, *rest, **kwargs), f"the filter {name!r}")

    return filt


def _metered_test(name: str, t: Callable) -> Callable:
    if name not in _COMPARING_TESTS:
        return t

    @functools.wraps(t)
    def test(*args: Any, **kwargs: Any) -> Any:
        lim = current_limits()
        lim.charge(text_size((args, kwargs), lim.size)[0])
        return t(*args, **kwargs)

    return test


def _lipsum(f: Callable) -> Callable:
    @functools.wraps(f)
    def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 (jinja's names)
        current_limits().bound(as_int(n) * as_int(max) * 20, "lipsum()")  # words of at most ~15 characters, markup
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
    current_limits().bound(16 * len(fmt), "strftime_now()")  # `%c` (2 characters) writes 24
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
    token = use_limits(limits)
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
        reset_limits(token)


def error_line(e: BaseException) -> int | None:
    """The template line an error was raised at (jinja rewrites tracebacks to point at `<template>` lines)."""
    line, tb = None, e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line

