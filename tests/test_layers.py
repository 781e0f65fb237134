"""The layers import one way, and no module of the product grows past 500 lines.

foundation ← semcache, backends ← server; harness (tests' and bench's servers and fakes)
and bench sit on top and are never imported by the product; nothing imports tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PROJECT = {"foundation", "semcache", "backends", "server", "harness", "bench", "tests"}
MAY_IMPORT = {
    "foundation": set(),
    "semcache": {"foundation"},
    "backends": {"foundation"},
    "server": {"foundation", "semcache", "backends"},
    "harness": {"foundation", "semcache", "backends", "server"},
    "bench": {"foundation", "semcache", "backends", "server", "harness"},
}
PRODUCT = ("foundation", "semcache", "backends", "server")
MAX_LINES = 500


def imported_packages(path: Path) -> set[str]:
    """The project's top-level packages a module imports (at any depth of its code)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & PROJECT


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_a_layer_imports_only_the_layers_below_it(package: str) -> None:
    wrong = {
        str(path.relative_to(REPO_ROOT)): sorted(extra)
        for path in sorted((REPO_ROOT / package).rglob("*.py"))
        if (extra := imported_packages(path) - MAY_IMPORT[package] - {package})
    }
    assert not wrong, wrong


def test_no_module_of_the_product_is_over_500_lines() -> None:
    long = {
        str(path.relative_to(REPO_ROOT)): lines
        for package in PRODUCT
        for path in sorted((REPO_ROOT / package).rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


SERVER_BELOW: dict[str, set[str]] = {
    "http": set(),
    "limits": set(),
    "guard": set(),
    "identity": {"limits"},
    "serving": {"guard", "http", "identity", "limits"},
    "envelope": {"http", "identity", "limits", "serving"},
    "batch": {"envelope", "http", "identity", "limits", "serving"},
    "pools": {"http", "identity", "serving"},
}
"""Inside ``server/``, what each package may import of the others (the shared modules at
the top, ``errors``, ``metrics``, ``config`` and so on, aside): the order a request meets
them, read backwards. The surfaces (openai, workers_ai, admin, gateway_api, dashboard) sit on
top; the serving core never imports a surface, the envelope, a batch or a pool."""


def server_packages(path: Path) -> set[str]:
    """The ``server`` subpackages a module imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        for name in names:
            parts = name.split(".")
            if (
                parts[0] == "server"
                and len(parts) > 1
                and (REPO_ROOT / "server" / parts[1]).is_dir()
            ):
                found.add(parts[1])
    return found


@pytest.mark.parametrize("package", sorted(SERVER_BELOW))
def test_a_server_package_imports_only_the_ones_below_it(package: str) -> None:
    wrong = {
        str(path.relative_to(REPO_ROOT)): sorted(extra)
        for path in sorted((REPO_ROOT / "server" / package).rglob("*.py"))
        if (extra := server_packages(path) - SERVER_BELOW[package] - {package})
    }
    assert not wrong, wrong
