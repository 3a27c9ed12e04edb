"""Module boundaries of ``xmc_engine/``, ``kernels/`` and ``datasets/``, read with ``ast``.

Two rules (STYLE.md "Private stays private", issue 13): a leading-underscore name never crosses a
module (``from m import _name``, ``m._name``), and the imports between the engine's modules form
no cycle. A private *module* (``_env``, ``kernels/_cuda``) is shared inside the package that holds
it (CuPy's ``cupy._core`` habit) and nowhere else.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> the package it is installed as (pyproject's package-dir mapping)
PACKAGES = {"xmc_engine": "xmc_engine", "kernels": "xmc_engine.kernels",
            "datasets": "xmc_engine.datasets"}



def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the three packages."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


MODULES = module_files()


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def resolve(module: str, node: ast.ImportFrom) -> str:
    """Absolute dotted name of an ``from ... import`` statement's source module."""
    if not node.level:
        return node.module or ""
    is_package = MODULES[module].name == "__init__.py"
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def may_use_private_module(user: str, private: str) -> bool:
    """A private module is shared within the package that holds it (and its subpackages)."""
    package = private.rsplit(".", 1)[0]
    return user == package or user.startswith(package + ".")


def private_crossings(module: str) -> list[str]:
    """The places where ``module`` uses another module's leading-underscore name."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    found = []
    aliases: dict[str, str] = {}  # local name -> project module it is bound to

    def check_module_path(dotted: str, lineno: int):
        parts = dotted.split(".")
        for k, part in enumerate(parts):
            if is_private(part):
                private = ".".join(parts[: k + 1])
                if private != module and not may_use_private_module(module, private):
                    found.append(f"line {lineno}: imports private module {private}")
                return

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("xmc_engine"):
                    check_module_path(a.name, node.lineno)
                    if a.asname:
                        aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            src = resolve(module, node)
            if not src.startswith("xmc_engine"):
                continue
            check_module_path(src, node.lineno)
            for a in node.names:
                full = f"{src}.{a.name}"
                if full in MODULES:
                    aliases[a.asname or a.name] = full
                if is_private(a.name) and src != module:
                    if full in MODULES and may_use_private_module(module, full):
                        continue
                    found.append(f"line {node.lineno}: from {src} import {a.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and is_private(node.attr)
                and isinstance(node.value, ast.Name) and node.value.id in aliases):
            target = aliases[node.value.id]
            full = f"{target}.{node.attr}"
            if target != module and not (full in MODULES and may_use_private_module(module, full)):
                found.append(f"line {node.lineno}: {node.value.id}.{node.attr} ({target})")
    return found


def imported_modules(module: str) -> set[str]:
    """Project modules ``module`` imports, at module level or inside functions."""
    tree = ast.parse(MODULES[module].read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in MODULES}
        elif isinstance(node, ast.ImportFrom):
            src = resolve(module, node)
            for a in node.names:
                if f"{src}.{a.name}" in MODULES:
                    out.add(f"{src}.{a.name}")
                elif src in MODULES:
                    out.add(src)
    out.discard(module)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(n):
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state:
                cycle = visit(m)
                if cycle:
                    return cycle
        state[n] = 2
        path.pop()
        return None

    for n in sorted(graph):
        if n not in state:
            cycle = visit(n)
            if cycle:
                return cycle
    return None


@pytest.mark.parametrize("module", MODULES)
def test_no_private_name_crosses_a_module(module):
    assert private_crossings(module) == []


def test_no_import_cycle():
    graph = {m: imported_modules(m) for m in MODULES}
    assert find_cycle(graph) is None


# -- the checks themselves catch what they are for ------------------------------------------------
def test_private_crossing_checks_find_both_forms(tmp_path, monkeypatch):
    src = tmp_path / "bad.py"
    src.write_text("from xmc_engine.kernels import output_layer\n"
                   "from xmc_engine.datasets.registry import _lookup\n"
                   "x = output_layer._hidden\n")
    monkeypatch.setitem(MODULES, "xmc_engine.bad", src)
    found = private_crossings("xmc_engine.bad")
    assert len(found) == 2 and "_lookup" in found[0] and "output_layer._hidden" in found[1]


def test_find_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
