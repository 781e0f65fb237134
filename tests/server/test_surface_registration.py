"""A surface registered from one package (``tests/server/mini_surface``) gets what every
surface gets, with no change to the shared layers: authentication with its own key header
and query parameter, the limits, early hits, draining, its own errors and its OpenAPI
entries. Served over HTTP by the app ``semcache serve`` builds, a fake chat backend behind it
(the backend is not what this is about)."""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from backends.registry import ModelInfo, ModelRegistry
from harness.fake_vllm import FakeGeneration
from harness.gateway import GatewayThread
from harness.metrics import parse_metric
from server.config import parse_config
from server.surfaces import builtin_surfaces
from tests.server.mini_surface.surface import PATH
from tests.server.mini_surface.surface import SURFACE as MINI

REPO = Path(__file__).resolve().parents[2]
CONFIG = """
[limits]
requests_per_minute = 1000
[[auth.tokens]]
token = "tok-a"
tenant = "acme"
[[auth.tokens]]
token = "tok-tight"
tenant = "acme"
name = "tight"
limits = { requests_per_minute = 2 }
"""
BODY = {"model": "chat-model", "contents": "hello there"}


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[GatewayThread, FakeGeneration]]:
    (tmp_path / "policy.toml").write_text("version = 1\n[defaults]\nttl_s = 600\n")
    toml = f'data_dir = "{tmp_path}"\npolicy = "{tmp_path / "policy.toml"}"\n{CONFIG}'
    config = parse_config(tomllib.loads(toml))
    fake = FakeGeneration()
    registry = ModelRegistry()
    registry.generation["fake"] = fake
    registry.add(ModelInfo("chat-model", "chat", (), "t", "fake", "rev1", "tpl"))
    gw = GatewayThread(config, registry, surfaces=[*builtin_surfaces(config), MINI]).start()
    try:
        yield gw, fake
    finally:
        gw.stop()


def generate(http: httpx.Client, body: Any = BODY, path: str = PATH, **headers: str) -> Any:
    sent = {"content-type": "application/json", **headers}
    return http.post(path, content=orjson.dumps(body), headers=sent)


def mini_error(response: httpx.Response, status: int) -> str:
    """The message of an error answered in the mini surface's own shape."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and isinstance(error["status"], str), error
    assert set(error) == {"code", "message", "status"}
    message: str = error["message"]
    return message


def test_its_key_places_and_its_error_shape(
    gateway: tuple[GatewayThread, FakeGeneration],
) -> None:
    gw, _ = gateway
    with httpx.Client(base_url=gw.url) as http:
        assert "token" in mini_error(generate(http), 401).lower()
        by_header = generate(http, **{"x-goog-api-key": "tok-a"})
        assert by_header.status_code == 200 and by_header.json() == {"text": "hello"}
        by_query = generate(http, path=f"{PATH}?key=tok-a")
        assert by_query.status_code == 200 and by_query.json() == {"text": "hello"}
        assert generate(http, **{"authorization": "Bearer tok-a"}).status_code == 200
        mini_error(generate(http, **{"x-goog-api-key": "nope"}), 401)
        # Its key header is its own: OpenAI's routes ignore it, and answer in their shape.
        chat = {"model": "chat-model", "messages": [{"role": "user", "content": "hi"}]}
        refused = generate(http, chat, "/v1/chat/completions", **{"x-goog-api-key": "tok-a"})
        assert refused.status_code == 401 and refused.json()["error"]["type"]
        assert "status" not in refused.json()["error"]
        key = {"x-goog-api-key": "tok-a"}
        assert "does not exist" in mini_error(generate(http, {**BODY, "model": "x"}, **key), 404)
        assert "contents" in mini_error(generate(http, {"model": "chat-model"}, **key), 400)


def test_its_requests_meet_the_limits(gateway: tuple[GatewayThread, FakeGeneration]) -> None:
    gw, _ = gateway
    tight = {"x-goog-api-key": "tok-tight"}
    with httpx.Client(base_url=gw.url) as http:
        sent = [generate(http, {**BODY, "contents": f"n{i}"}, **tight) for i in range(3)]
        assert [r.status_code for r in sent[:2]] == [200, 200]
        assert sent[0].headers["x-ratelimit-limit-requests"] == "2"
        mini_error(sent[2], 429)
        assert int(sent[2].headers["retry-after"]) >= 1


def test_its_repeats_are_answered_early(gateway: tuple[GatewayThread, FakeGeneration]) -> None:
    gw, fake = gateway
    key = {"x-goog-api-key": "tok-a"}
    with httpx.Client(base_url=gw.url) as http:
        sent = [generate(http, **key) for _ in range(3)]
        early = parse_metric(
            http.get("/metrics").text, "semcache_early_hits_total", {"route": "chat"}
        )
    assert [r.headers["cf-aig-cache-status"] for r in sent] == ["MISS", "HIT", "HIT"]
    assert early == 1.0  # the route's hit taught the third
    assert sent[2].content == sent[1].content == sent[0].content
    assert len(fake.calls) == 1


def test_it_is_refused_in_its_own_shape_while_draining(
    gateway: tuple[GatewayThread, FakeGeneration],
) -> None:
    gw, _ = gateway
    drain = gw.app.state["drain"]
    drain.draining = True
    try:
        with httpx.Client(base_url=gw.url) as http:
            refused = generate(http, **{"x-goog-api-key": "tok-a"})
            assert "shutting down" in mini_error(refused, 503)
            assert refused.headers["connection"] == "close"
            assert http.get("/health").status_code == 200
            assert http.get("/ready").json() == {"status": "draining"}
    finally:
        drain.draining = False


def test_its_openapi_entries(gateway: tuple[GatewayThread, FakeGeneration]) -> None:
    gw, _ = gateway
    with httpx.Client(base_url=gw.url) as http:
        document = http.get("/openapi.json").json()
    operation = document["paths"][PATH]["post"]
    for status in ("400", "401", "404", "429"):
        schema = operation["responses"][status]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/MiniError"}
    assert operation["security"] == [{"bearer": []}, {"x-goog-api-key": []}, {"query-key": []}]
    schemes = document["components"]["securitySchemes"]
    assert schemes["x-goog-api-key"]["in"] == "header"
    assert schemes["query-key"] == {**schemes["query-key"], "in": "query", "name": "key"}
    assert "MiniError" in document["components"]["schemas"]
    assert "GenerateRequest" in document["components"]["schemas"]
    # the built-in surfaces keep theirs
    messages = document["paths"]["/v1/messages"]["post"]
    assert messages["security"] == [{"bearer": []}, {"x-api-key": []}]
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert chat["security"] == [{"bearer": []}]


SURFACE_PACKAGES = {"openai", "anthropic", "workers_ai", "gateway_api", "admin", "dashboard"}
SURFACE_PACKAGES.add("health")
REGISTRATION = REPO / "server" / "surfaces.py"


def test_no_shared_module_imports_a_surface() -> None:
    """Shared code reads the registered surfaces; only the registration names them."""
    surface_dirs = {REPO / "server" / name for name in SURFACE_PACKAGES}
    wrong: dict[str, list[str]] = {}
    for path in sorted((REPO / "server").rglob("*.py")):
        if path == REGISTRATION or any(d in path.parents for d in surface_dirs):
            continue
        names: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.append(node.module)
            elif isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
        found = sorted(
            name
            for name in names
            if name.startswith("server.") and name.split(".")[1] in SURFACE_PACKAGES
        )
        if found:
            wrong[str(path.relative_to(REPO))] = found
    assert not wrong, wrong
