"""Load options are declared once (sluice/options.py); the flags of every command, the way back from flags, the
bench arms and the README table all come from that declaration."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from sluice import cli, options
from sluice.bench import arms
from sluice.commands import common
from sluice.errors import ConfigError
from sluice.options import LoadOptions, declarations, flag, option, options_from_args, options_table

README = Path(__file__).resolve().parents[1] / "README.md"
LOADING_COMMANDS = ("run", "chat", "serve", "inspect")
# argv after `sluice COMMAND` that satisfies each loading command's other required arguments
REQUIRED = {"run": ["M", "--prompt", "x"], "chat": ["M"], "serve": ["M"], "inspect": ["M"]}
# options with their own parse function: (flag value, value LoadOptions holds), none of them the default
PARSED = {"memory": [("1GiB", 2**30), ("512MB", 512 * 10**6), ("123", 123), ("all", None), ("AUTO", "auto")],
          "prefill_chunk": [("1", 1), ("2048", 2048)]}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def _parsers() -> dict[str, argparse.ArgumentParser]:
    commands = _subparsers(cli.build_parser())
    return {**{c: commands[c] for c in LOADING_COMMANDS}, "bench --arm": arms._flag_parser()}


def _non_defaults(f: dataclasses.Field, opt: options.Option) -> list[tuple[list[str], object]]:
    """(flag argv, expected LoadOptions value) for values other than the default, from the declaration."""
    if opt.parse is not None:
        return [([flag(f.name), text], value) for text, value in PARSED[f.name]]
    if opt.choices is not None:
        return [([flag(f.name), c], c) for c in opt.choices if c != f.default]
    if opt.boolean:
        return [([flag(f.name) if v else "--no-" + flag(f.name)[2:]], v) for v in (True, False) if v != f.default]
    assert opt.least is not None, f"{f.name}: a new kind of option; say here which values to round-trip"
    values = {opt.least, opt.least + 1, opt.most if opt.most is not None else opt.least + 7} - {f.default}
    return [([flag(f.name), str(v)], v) for v in sorted(values)]


CASES = [(f.name, argv, value) for f, opt in declarations() for argv, value in _non_defaults(f, opt)]


def test_every_option_has_exactly_one_flag_on_each_loading_command():
    for command, parser in _parsers().items():
        for f, opt in declarations():
            actions = [a for a in parser._actions if a.dest == f.name]
            assert len(actions) == 1, f"{command}: {len(actions)} flags for {f.name}"
            strings = [flag(f.name), "--no-" + flag(f.name)[2:]] if opt.boolean else [flag(f.name)]
            assert actions[0].option_strings == strings, command


@pytest.mark.parametrize("command", LOADING_COMMANDS)
def test_no_flags_give_the_default_options(command):
    ns = cli.build_parser().parse_args([command, *REQUIRED[command]])
    assert options_from_args(ns) == LoadOptions()
    assert arms.parse_flags("a", "") == {}


@pytest.mark.parametrize("name,argv,value", CASES, ids=[" ".join(c[1]) for c in CASES])
def test_every_non_default_value_round_trips(name, argv, value):
    ns = cli.build_parser().parse_args(["run", *REQUIRED["run"], *argv])
    got = options_from_args(ns)
    assert getattr(got, name) == value
    assert got == dataclasses.replace(LoadOptions(), **{name: value})  # and nothing else moved
    kwargs = arms.parse_flags("a", " ".join(argv))
    assert list(kwargs) == [name] and LoadOptions.make(**kwargs) == got


def test_every_parsed_option_has_round_trip_values():
    assert {f.name for f, opt in declarations() if opt.parse is not None} == set(PARSED)


def test_readme_options_table_is_the_declared_one():
    table = options_table()
    assert table in README.read_text(), f"README.md \"### Options\" should hold this table:\n{table}"
    for f, _ in declarations():
        assert f"`{flag(f.name)}" in table


def test_subsets_keep_their_commands_defaults():
    demo = cli.build_parser().parse_args(["demo"])
    assert demo.memory is None and demo.io == "direct"  # None: demo picks a budget that streams
    fit = cli.build_parser().parse_args(["prerouter", "fit", "M"])
    assert options.option_kwargs(fit) == {"memory": "auto", "io": "direct", "dtype": "auto", "threads": 0}
    with pytest.raises(SystemExit):  # not offered where recording does not use it
        cli.build_parser().parse_args(["prerouter", "fit", "M", "--prefetch", "router"])


def test_unknown_names_are_errors_listing_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown option\(s\) turbo; known: activations, dtype, embeddings, io, "):
        LoadOptions.make(turbo=True)
    with pytest.raises(ConfigError, match="unknown option.*turbo"):
        options.add_load_arguments(argparse.ArgumentParser(), only=("memory", "turbo"))


@pytest.mark.parametrize("kwargs,needle", [
    (dict(overlap="yes"), "overlap: expected True or False, got 'yes'"),
    (dict(odirect=1), r"odirect: expected True or False or None \(auto\), got 1"),
    (dict(dtype=["bf16"]), "dtype: .* is not one of auto, float32, bfloat16, float16"),
    (dict(io="floppy"), "io: 'floppy' is not one of mmap, willneed, direct"),
    (dict(embeddings="disk"), "embeddings: 'disk' is not one of resident, mmap, direct"),
    (dict(prefetch_margin=-1), "prefetch_margin: must be an integer >= 0, got -1"),
    (dict(prefill_chunk=0), "prefill_chunk: must be a positive integer, got 0"),
    (dict(prefill_chunk="many"), "prefill_chunk: must be a positive integer, got 'many'"),
    (dict(prefill_chunk=True), "prefill_chunk: must be a positive integer, got True"),
])
def test_checks_come_from_the_declaration(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        LoadOptions.make(**kwargs)


def test_aliases_and_auto_values_are_accepted():
    o = LoadOptions.make(dtype="bf16", odirect=None, memory=" All ")
    assert (o.dtype, o.odirect, o.memory) == ("bfloat16", None, None)


@dataclasses.dataclass
class _WithTurbo(LoadOptions):
    turbo: int = option(3, metavar="N", least=1, help="turbo stages", doc="turbo stages")


def test_a_new_option_reaches_load_options_without_touching_the_commands(monkeypatch):
    monkeypatch.setattr(options, "LoadOptions", _WithTurbo)
    parser = cli.build_parser()
    ns = parser.parse_args(["serve", "M", "--turbo", "5", "--io", "mmap"])
    got = options_from_args(ns)
    assert isinstance(got, _WithTurbo) and (got.turbo, got.io) == (5, "mmap")
    assert options_from_args(parser.parse_args(["run", "M", "--prompt", "x"])).turbo == 3
    assert "--turbo N" in _subparsers(parser)["chat"].format_help()
    with pytest.raises(ConfigError, match="turbo: must be a positive integer, got 0"):
        options_from_args(parser.parse_args(["inspect", "M", "--turbo", "0"]))
    assert arms.parse_flags("t", "--turbo 2") == {"turbo": 2}
    loaded = []
    monkeypatch.setattr(common, "Model", lambda path, opts, progress: loaded.append(opts))
    common.load_from_args(ns)
    assert loaded == [got]
    assert "| `--turbo N` | 3 | turbo stages |" in options_table()
