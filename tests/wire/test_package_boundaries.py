"""The import layering of the packages: psg_core at the bottom, psg_wire above it, and psg_server and
psg_client side by side on top, sharing only psg_wire and psg_core.

Every module of each package is parsed (not imported), so an import inside a function counts as
much as one at the top of a file.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIRS: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
    "package-dir"]

#: package -> the psg packages it must never import.
FORBIDDEN = {
    "psg_core": {"psg_wire", "psg_server", "psg_client"},
    "psg_wire": {"psg_server", "psg_client"},
    "psg_server": {"psg_client"},
    "psg_client": {"psg_server"},
}


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` of every import statement in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_every_package_has_a_rule() -> None:
    assert set(PACKAGE_DIRS) == set(FORBIDDEN)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_stay_within_its_layer(package: str) -> None:
    folder = REPO / PACKAGE_DIRS[package]
    modules = sorted(folder.rglob("*.py"))
    assert modules, folder
    crossings = []
    for path in modules:
        for line, module in imported_modules(ast.parse(path.read_text(), str(path))):
            if module.split(".")[0] in FORBIDDEN[package]:
                crossings.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not crossings, f"{package} must not import {sorted(FORBIDDEN[package])}:\n" + "\n".join(crossings)


def test_the_checker_sees_imports_inside_functions() -> None:
    tree = ast.parse("def f():\n    from psg_server.models import default_registry\n    import psg_client.demo\n")
    assert imported_modules(tree) == [(2, "psg_server.models"), (3, "psg_client.demo")]


def _module_name(package: str, folder: Path, path: Path) -> str:
    parts = [package] + [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
    return ".".join(parts)


def test_no_import_cycle_between_modules() -> None:
    """No module imports (at import time, i.e. at the top of the file) a module that imports it
    back, directly or through others: backends are registered in one place, not by side effect."""
    modules = {_module_name(pkg, REPO / folder, path): path
               for pkg, folder in PACKAGE_DIRS.items() for path in (REPO / folder).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.parse(path.read_text()).body:  # top level only; TYPE_CHECKING blocks are ifs
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
