"""Chat templates render with bounds on size, work and steps (sluice/tokenizer/template.py): a runaway or broken
template is one RequestError naming it, and real templates render as plain jinja renders them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from sluice.errors import RequestError
from sluice.tokenizer import Tokenizer
from sluice.tokenizer.template import Limits, _tojson, render
from sluice.tools.tokenizer_train import train_tokenizer

HI = [{"role": "user", "content": "hi"}]
SHARED = "{% set ns = namespace(a=['xxxxxxxxxx']) %}{% for i in range(60) %}{% set ns.a = [ns.a, ns.a] %}{% endfor %}"

# (template, what the error says): each one crashed sluice with "internal error", ran for hours or took all memory.
RUNAWAY = [
    ("{% for i in range(100000000) %}x{% endfor %}", "OverflowError: Range too big"),
    ("{{ 'x' * 300000000 }}", "'*' makes 300,000,000 characters"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ("{{ 1 + 'a' }}", "TypeError: unsupported operand"),
    ("{{ foo.bar }}", "UndefinedError: 'foo' is undefined"),
    # work without output: hours before
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "loop iterations and calls"),
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
     "loop iterations and calls"),
    # exponential growth, each step small
    ("{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "'~' makes"),
    ("{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "'+' makes"),
    ("{{ 2 ** 100000000 }}", "'**' makes a number"),
    (SHARED + "{{ ns.a }}", "a value's text is over the limit"),
    (SHARED + "{{ ns.a|tojson }}", "a value's text is over the limit"),
    (SHARED + "{% set ns.b = ns.a %}{{ ns.a == ns.b }}", "a value's text is over the limit"),
    # one call, one huge value
    ("{{ 'x'.ljust(300000000) }}", "ljust() with the number 300,000,000"),
    ("{{ (5).to_bytes(300000000, 'big') }}", "to_bytes() with the number 300,000,000"),
    ("{{ 'x'|center(300000000) }}", "the filter 'center' makes 300,000,000"),
    ("{{ ('a\n' * 100000)|indent(1000) }}", "the filter 'indent' makes"),
    ("{{ '%300000000s' % 'x' }}", "'%' makes"),
    ("{{ '{:>300000000}'.format('x') }}", "format() makes"),
    ("{{ '{:{w}}'.format('x', w=300000000) }}", "format() makes"),
    ("{{ '%*s' % (300000000, 'x') }}", "'%' makes"),
    ("{{ (['x' * 1000000] * 1000)|join }}", "a value's text is over the limit"),
    # many values, each within the size limit
    ("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = ns.l + [('x' * 1000000) ~ i] %}"
     "{% endfor %}", "bytes of values in all"),
    ("{{ (['x' * 1000000] * 1000)|map('upper')|list|length }}", "bytes of values in all"),
    ("{% macro m() %}{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}{% endmacro %}{{ m()|length }}",
     "bytes of values in all"),
    ("{% for i in range(100000) %}{% for j in range(100) %}xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx{% endfor %}{% endfor %}",
     "its output passes the limit"),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=300)


def with_template(folder: Path, dest: Path, template: str) -> Path:
    """A copy of the tokenizer folder whose tokenizer_config.json holds `template`."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(folder / "tokenizer.json", dest / "tokenizer.json")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (dest / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return dest


@pytest.mark.parametrize("template,needle", RUNAWAY)
def test_a_runaway_template_is_one_clean_error_naming_it(folder, tmp_path, template, needle):
    tok = Tokenizer.from_folder(with_template(folder, tmp_path / "m", template))
    with pytest.raises(RequestError) as e:
        tok.apply_chat_template(HI)
    msg = str(e.value)
    assert needle in msg and msg.startswith(f"the chat template of model {tmp_path / 'm'}")
    assert "\n" not in msg
    assert e.value.__cause__ is None and e.value.__suppress_context__  # no frames (and the prompt) kept alive


def test_errors_name_the_template_and_line(folder, tmp_path):
    tok = Tokenizer.from_folder(with_template(folder, tmp_path / "m", "a\nb\n{{ 1 // 0 }}"))
    with pytest.raises(RequestError, match=r"the chat template of model .* failed at line 3: ZeroDivisionError"):
        tok.apply_chat_template(HI)
    with pytest.raises(RequestError, match=r"^the template passed as chat_template at line 1 was stopped: '\*'"):
        tok.apply_chat_template(HI, chat_template="{{ 'x' * 10**9 }}")
    with pytest.raises(RequestError, match=r"rejected the messages at line 1: no"):
        tok.apply_chat_template(HI, chat_template="{{ raise_exception('no') }}")
    named = with_template(folder, tmp_path / "n", [{"name": "default", "template": "{{ 1 // 0 }}"}])
    with pytest.raises(RequestError, match=r"^chat template 'default' of model .*/n failed at line 1"):
        Tokenizer.from_folder(named).apply_chat_template(HI)


def _plain(template: str, **variables) -> str:
    """What the sandbox transformers uses renders, without limits."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.globals["namespace"] = jinja2.utils.Namespace
    env.filters["tojson"] = _tojson
    return env.from_string(template).render(**variables)


# Constructs the rewrite touches (loops, filters that take the context, recursive loops, macros with caller, set
# blocks, comparisons, `~`, formatting): the output must not change.
SAME = [
    "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ m.role ~ ':' ~ m.content }}{% if not loop.last %}|"
    "{% endif %}{% else %}none{% endfor %}",
    "{% for m in messages if m.role != 'system' %}{{ m.content|upper }}{% endfor %}",
    "{{ messages|map(attribute='content')|join(', ') }}"
    "{{ messages|selectattr('role', 'equalto', 'user')|list|length }}",
    "{% for x in [[1, [2, 3]], 4] recursive %}({% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}{% endif %})"
    "{% endfor %}",
    "{% macro wrap(t) %}<{{ caller() }}|{{ t }}>{% endmacro %}"
    "{% call wrap('a') %}{{ messages[0].content }}{% endcall %}",
    "{% set block %}{% for i in range(3) %}{{ i }}{% endfor %}{% endset %}{{ block * 2 }}{{ '%s-%03d' % ('a', 7) }}",
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' and 'i' in m.content %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{{ ns.last }}{{ '{0}{1}'.format('x', 2 ** 10) }}",
    "{% for m in messages[::-1] %}{{ m.content[:2] }}{% break %}{% endfor %}{{ messages|tojson }}"
    "{{ (messages|first).content.ljust(6, '.') }}{{ 'a b c'.split()|reverse|join }}{{ 'x'|indent(2, true) }}",
]


@pytest.mark.parametrize("template", SAME)
def test_metered_rendering_matches_plain_jinja(folder, template):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    variables = {"messages": messages, "add_generation_prompt": True}
    limits = Limits.for_input(variables, messages=2)
    assert render(template, limits, **variables) == _plain(template, **variables)
    assert 0 < limits.made < limits.work and limits.taken < limits.steps


def test_a_long_conversation_under_a_quadratic_template_fits(folder):
    """Templates that add each message to a string cost the square of the conversation (Reka-Edge's: 249 MB of
    copies for 1,001 messages): 1,000 messages must still render, as plain jinja renders them."""
    template = ("{% set ns = namespace(out='') %}{% for m in messages %}"
                "{% set ns.out = ns.out ~ '<|' ~ m.role ~ '|>' ~ m.content ~ '\n' %}{% endfor %}{{ ns.out }}")
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"message {i} " * 20} for i in range(1000)]
    variables = {"messages": messages}
    limits = Limits.for_input(variables, messages=len(messages))
    assert render(template, limits, **variables) == _plain(template, **variables)
