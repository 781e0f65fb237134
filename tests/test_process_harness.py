"""The slow tests, which prove features, run ``semcache serve`` (``GatewayProcess``); the
in-process ``GatewayThread`` serves fast unit tests only.

A slow test (``pytestmark = pytest.mark.slow`` or its own mark) is threaded when its body
names ``GatewayThread``, or names or takes (as a fixture) a function or class of its module
that is threaded in turn (a helper the test defines itself shadows the module's).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
THREAD = "GatewayThread"


def _is_slow_mark(node: ast.expr) -> bool:
    text = ast.unparse(node)
    return text == "pytest.mark.slow" or text.startswith("pytest.mark.slow(")


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def threaded_slow_tests(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    module_slow = any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        and any(_is_slow_mark(m) for m in ast.walk(node.value) if isinstance(m, ast.expr))
        for node in tree.body
    )
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    helpers = [*functions, *(n for n in tree.body if isinstance(n, ast.ClassDef))]
    threaded = {THREAD}
    while True:  # a helper is threaded when it names a threaded helper (fixtures, wrappers)
        more = {h.name for h in helpers if threaded & _names(h)} - threaded
        if not more:
            break
        threaded |= more
    found = []
    for f in functions:
        if not f.name.startswith("test_"):
            continue
        slow = module_slow or any(_is_slow_mark(d) for d in f.decorator_list)
        params = {a.arg for a in f.args.args + f.args.kwonlyargs}
        inner = {  # a helper the test defines for itself shadows the module's
            n.name for n in ast.walk(f) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        } - {f.name}
        used = (_names(f) - inner) | params
        if slow and threaded & used:
            found.append(f"{path.relative_to(TESTS.parent)}::{f.name}")
    return found


def test_no_slow_test_runs_the_gateway_in_a_thread() -> None:
    found = [t for p in sorted(TESTS.rglob("test_*.py")) for t in threaded_slow_tests(p)]
    assert found == [], "slow tests on GatewayThread (use GatewayProcess):\n" + "\n".join(found)


def test_the_rule_sees_a_fixture_a_slow_test_takes(tmp_path: Path) -> None:
    sample = TESTS / "_sample_threaded.py"
    source = (
        "import pytest\n"
        "def gw():\n    return GatewayThread(None)\n"
        "@pytest.mark.slow\ndef test_a(gw):\n    assert gw\n"
        "def test_fast(gw):\n    assert gw\n"
    )
    sample.write_text(source)
    try:
        assert threaded_slow_tests(sample) == ["tests/_sample_threaded.py::test_a"]
    finally:
        sample.unlink()
