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
