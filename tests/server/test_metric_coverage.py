"""Every metric family the gateway exports is asserted by some test.

The app is built as ``semcache serve`` builds it (``create_app`` from a gateway config
with a vLLM backend, the exact cache, the semantic service and the batch workers) and
started; the families are what its registry (the one ``/metrics`` renders) collects, samples or
not. A family counts as covered when its name (alone or with ``_total``, ``_count``,
``_sum`` or ``_bucket``) appears as a string inside a function that asserts (a ``def``
whose body holds an ``assert``: a test, or a helper that checks what it reads) in a test
module under ``tests/`` other than this one. A name assembled at run time does not count.

The ``semcache_upstream_vllm_*`` families are copies of a vLLM server's own families,
present only once a server was scraped; ``tests/server/test_metrics_live.py`` asserts them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from litestar.testing import TestClient

from backends.config import VllmBackendConfig, VllmServer
from harness.ports import free_port
from server.app import create_app
from server.config import GatewayConfig, ModelEntry

TESTS = Path(__file__).resolve().parents[1]
SUFFIXES = ("", "_total", "_count", "_sum", "_bucket")


def exported_families(tmp_path: Path) -> set[str]:
    """The families a started gateway exports (its vLLM server is down)."""
    config = GatewayConfig(
        data_dir=str(tmp_path),
        models=[ModelEntry(id="tiny-chat", backend="tiny", task="chat")],
        backends=[
            VllmBackendConfig(
                name="tiny",
                served_model="tiny",
                servers=[VllmServer(url=f"http://127.0.0.1:{free_port()}")],
            )
        ],
    )
    app = create_app(config)
    with TestClient[Any](app) as client:
        assert client.get("/metrics").status_code == 200
        return {family.name for family in app.state.metrics.registry.collect()}


def strings_in_asserting_functions(path: Path) -> set[str]:
    """Every string constant inside a function of ``path`` that holds an ``assert``."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        inner = list(ast.walk(node))
        if not any(isinstance(n, ast.Assert) for n in inner):
            continue
        out.update(
            n.value for n in inner if isinstance(n, ast.Constant) and isinstance(n.value, str)
        )
    return out


def covered(family: str, strings: set[str]) -> bool:
    pattern = re.compile(
        rf"(?<![A-Za-z0-9_]){re.escape(family)}({'|'.join(SUFFIXES[1:])})?(?![A-Za-z0-9_])"
    )
    return any(pattern.search(text) for text in strings)


def test_every_exported_family_is_asserted_by_a_test(tmp_path: Path) -> None:
    families = exported_families(tmp_path)
    assert "semcache_requests" in families and "semcache_pool_queue_depth" in families
    strings: set[str] = set()
    for path in TESTS.rglob("*.py"):
        if path.resolve() != Path(__file__).resolve():
            strings |= strings_in_asserting_functions(path)
    missing = sorted(f for f in families if not covered(f, strings))
    assert not missing, f"metric families no test asserts: {missing}"


def test_the_rule_sees_only_strings_in_functions_that_assert(tmp_path: Path) -> None:
    module = tmp_path / "test_sample.py"
    module.write_text(
        'NAME = "semcache_module_level"\n'
        "def helper(page):\n"
        '    assert read(page, "semcache_in_helper_total") == 1\n'
        "def test_reads():\n"
        '    value = read(page, "semcache_in_test_bucket")\n'
        "    assert value\n"
        "def setup():\n"
        '    send("semcache_never_asserted")\n'
    )
    strings = strings_in_asserting_functions(module)
    assert covered("semcache_in_helper", strings)
    assert covered("semcache_in_test", strings)
    assert not covered("semcache_module_level", strings)
    assert not covered("semcache_never_asserted", strings)
    assert not covered("semcache_in", strings)  # a prefix of a name is not the name
