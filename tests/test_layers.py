"""The layers import one way, and no module of the product grows past 500 lines.

foundation ← semcache, backends ← server; harness (tests' and bench's servers and fakes),
bench and the Python scripts of scripts/ sit on top and are never imported by the product;
nothing imports tests, and nothing but bench imports bench. Inside ``server/``, ``backends/``
and ``semcache/`` the packages import one way too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PROJECT = {"foundation", "semcache", "backends", "server", "harness", "bench", "scripts", "tests"}
MAY_IMPORT = {
    "foundation": set(),
    "semcache": {"foundation"},
    "backends": {"foundation"},
    "server": {"foundation", "semcache", "backends"},
    "harness": {"foundation", "semcache", "backends", "server"},
    "bench": {"foundation", "semcache", "backends", "server", "harness"},
    "scripts": {"foundation", "semcache", "backends", "server", "harness"},
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
    "stores": set(),
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


def subpackages(path: Path, top: str) -> set[str]:
    """The subpackages of ``top`` (``server``, ``backends``, ``semcache``) that a module
    imports; package data folders (``data``) are no package."""
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
                parts[0] == top
                and len(parts) > 1
                and parts[1] != "data"
                and (REPO_ROOT / top / parts[1]).is_dir()
            ):
                found.add(parts[1])
    return found


@pytest.mark.parametrize("package", sorted(SERVER_BELOW))
def test_a_server_package_imports_only_the_ones_below_it(package: str) -> None:
    wrong = {
        str(path.relative_to(REPO_ROOT)): sorted(extra)
        for path in sorted((REPO_ROOT / "server" / package).rglob("*.py"))
        if (extra := subpackages(path, "server") - SERVER_BELOW[package] - {package})
    }
    assert not wrong, wrong


BACKENDS_BELOW: dict[str, set[str]] = {
    "launch": set(),
    "local": set(),
    "fleet": {"launch"},
    "vllm": {"fleet", "launch", "local"},
}
"""Inside ``backends/``, what each package may import of the others: ``launch`` starts vLLM
servers and ``local`` runs models in process, both on the shared modules alone; the fleet
(``fleet``: pools, health, admission, placement and its ``kv/`` index) reads the launch
settings a server started with (its KV block size); the vLLM client and its P/D flow
(``vllm``) ask the fleet where each hop goes, and its classifier answers in the local
classifier's contract. Inside ``backends/`` only ``registry`` imports ``vllm``."""
BACKENDS_ASSEMBLY = {"registry"}
"""The top modules that put the packages together (a configured backend's instance); the
other top modules (``config``, ``interfaces``, ``upstream``, ``models``...) are what every
package shares, and import none of them."""


def test_the_backends_packages_are_the_ones_ordered() -> None:
    packages = {path.parent.name for path in (REPO_ROOT / "backends").glob("*/__init__.py")}
    assert packages == set(BACKENDS_BELOW)


@pytest.mark.parametrize("package", sorted(BACKENDS_BELOW))
def test_a_backends_package_imports_only_the_ones_below_it(package: str) -> None:
    wrong = {
        str(path.relative_to(REPO_ROOT)): sorted(extra)
        for path in sorted((REPO_ROOT / "backends" / package).rglob("*.py"))
        if (extra := subpackages(path, "backends") - BACKENDS_BELOW[package] - {package})
    }
    assert not wrong, wrong


def test_the_shared_backends_modules_import_no_package() -> None:
    wrong = {
        path.name: sorted(found)
        for path in sorted((REPO_ROOT / "backends").glob("*.py"))
        if path.stem not in BACKENDS_ASSEMBLY and (found := subpackages(path, "backends"))
    }
    assert not wrong, wrong


SEMCACHE_BELOW: dict[str, set[str]] = {
    "tiers": set(),
    "ledger": {"tiers"},
    "exact": {"tiers"},
    "semantic": {"exact", "tiers"},
    "tuning": {"semantic"},
}
"""Inside ``semcache/``, what each package may import of the others: the stores (``tiers``)
at the bottom; the usage ledger keeps its Redis counters over the tiers' Redis link; the exact
cache (``exact``, with its purge epochs) walks the tiers; the semantic cache keeps its
per-item answers in the exact cache; the offline tuning (``tuning``) reads the semantic
cache's encoder and verifier, and nothing imports it."""


def test_the_semcache_packages_are_the_ones_ordered() -> None:
    packages = {path.parent.name for path in (REPO_ROOT / "semcache").glob("*/__init__.py")}
    assert packages == set(SEMCACHE_BELOW)


@pytest.mark.parametrize("package", sorted(SEMCACHE_BELOW))
def test_a_semcache_package_imports_only_the_ones_below_it(package: str) -> None:
    wrong = {
        str(path.relative_to(REPO_ROOT)): sorted(extra)
        for path in sorted((REPO_ROOT / "semcache" / package).rglob("*.py"))
        if (extra := subpackages(path, "semcache") - SEMCACHE_BELOW[package] - {package})
    }
    assert not wrong, wrong


def test_the_shared_semcache_modules_import_no_package() -> None:
    """The top modules (keys, entries, the policy and its settings, metrics...) are what every
    package shares: the policy reads a rule's semantic settings from ``semantic_settings``,
    not from the semantic package above it."""
    wrong = {
        path.name: sorted(found)
        for path in sorted((REPO_ROOT / "semcache").glob("*.py"))
        if (found := subpackages(path, "semcache"))
    }
    assert not wrong, wrong
