"""The package's shape, checked from its syntax trees (nothing is imported): no import cycles, each folder imports only
folders below it in the data flow, files small enough to read (issue 29).

The data flow, bottom to top (DESIGN.md): facts everything may use (errors, units, host), where bytes are
(checkpoint), how they move (io), the tokenizer, formats -> math (quant), what stays in memory (store), the model
math (models), next-layer prediction (prerouter), the wiring (options, plan, prompts, engine, generate, sampling), then
the front ends (commands, server, serve_ray, bench, tools, cli). A module may import its own folder and any lower level.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sluice"

#: each entry one level, lowest first: the folders (or root modules) of sluice/ it holds
LEVELS = [
    {"errors", "units", "host"},
    {"checkpoint"},
    {"io"},
    {"tokenizer"},
    {"quant"},
    {"store"},
    {"models"},
    {"prerouter"},
    {"options", "plan", "prompts", "engine", "generate", "sampling"},
    {"tools"},
    {"bench", "server", "serve_ray", "commands", "cli", "__main__", "__init__"},
]
#: levels whose members may import each other (still without cycles): the shared facts, the wiring, the front ends
PEER_LEVELS = {0, 8, 10}
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `name` imports anywhere in its file (function-level imports included: they are still
    dependencies, only hidden)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _unit(module: str) -> str:
    """The folder (or root module) of sluice/ a module belongs to: sluice.quant.native.q8 -> quant."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _level(unit: str) -> int:
    for i, units in enumerate(LEVELS):
        if unit in units:
            return i
    raise AssertionError(f"sluice/{unit} is in no level of tests/test_structure.py LEVELS: place it in the data flow")


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    counter = 0
    for root in g:
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_cycles():
    assert _cycles(graph()) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_each_folder_imports_only_folders_below_it():
    wrong = []
    for module, targets in graph().items():
        for target in targets:
            a, b = _unit(module), _unit(target)
            la, lb = _level(a), _level(b)
            if a != b and (lb > la or (lb == la and la not in PEER_LEVELS)):
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_modules_and_functions_stay_small():
    big = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            big.append(f"{path.relative_to(PACKAGE.parent)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    big.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {n} lines")
    assert big == []


def _discovered(modules: dict[str, Path]) -> set[str]:
    """Modules the package finds by name at run time: the CLI's commands (cli.COMMANDS, importlib) and the
    architectures (models/__init__.py: every module of models/ that sets MODEL_TYPE)."""
    out = {m for m in modules if m.startswith("sluice.commands.")}
    for m, path in modules.items():
        if m.startswith("sluice.models.") and any(
                isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "MODEL_TYPE" for t in n.targets)
                for n in ast.parse(path.read_text()).body):
            out.add(m)
    return out


def test_nothing_in_the_package_is_reached_only_by_tests():
    """Every module is imported by another module of the package (a package by any of its modules), found by name
    at run time (_discovered), or an entry point: the package, `python -m sluice`, the bench's child scripts."""
    g = graph()
    reached = {"sluice", "sluice.__main__", "sluice.bench.peer_child", "sluice.bench.child"} | _discovered(_modules())
    for module, targets in g.items():
        reached |= targets
    for module in list(reached):  # importing a module imports the packages above it
        parts = module.split(".")
        reached |= {".".join(parts[:i]) for i in range(1, len(parts))}
    assert sorted(m for m in g if m not in reached) == []
