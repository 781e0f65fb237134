"""``/openapi.json`` documents every route the app registers, and ``/docs`` is served by the
gateway itself."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from litestar import Litestar
from litestar.routes import HTTPRoute
from litestar.testing import TestClient

from server.apidoc.operation import DocumentedOperation
from server.app import create_app
from server.config import GatewayConfig

UNDOCUMENTED = ("/openapi.json", "/docs", "/dashboard")
"""The document itself, the docs UI and the operator dashboard (HTML pages), and what lies
under each."""


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient[Litestar]]:
    """The app ``semcache serve`` builds; the routes do not depend on the models configured."""
    config = GatewayConfig(data_dir=str(tmp_path_factory.mktemp("gateway")))
    with TestClient(create_app(config)) as client:
        yield client


@pytest.fixture(scope="module")
def app(client: TestClient[Litestar]) -> Litestar:
    return client.app


@pytest.fixture(scope="module")
def document(client: TestClient[Litestar]) -> dict[str, Any]:
    response = client.get("/openapi.json")
    assert response.status_code == 200
    doc: dict[str, Any] = response.json()
    return doc


def registered(app: Litestar) -> Iterator[tuple[str, str, Any]]:
    for route in app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        path = route.path_format
        if any(path == p or path.startswith(p + "/") for p in UNDOCUMENTED):
            continue
        for method, (handler, _) in route.route_handler_map.items():
            if method not in ("HEAD", "OPTIONS"):
                yield path, method.lower(), handler


def test_every_registered_route_is_documented(app: Litestar, document: dict[str, Any]) -> None:
    routes = list(registered(app))
    assert len(routes) >= 26
    documented = {(p, m) for p, item in document["paths"].items() for m in item}
    assert {(p, m) for p, m, _ in routes} == documented
    for path, method, handler in routes:
        # A route without a RouteDoc would get Litestar's guesses (a 201, a body of `{}`).
        assert issubclass(handler.operation_class, DocumentedOperation), (method, path)
        # The security the document declares is the one the tenancy middleware applies.
        public = handler.opt.get("auth") == "public"
        assert handler.operation_class.doc.auth is not public, (method, path)
        operation = document["paths"][path][method]
        assert "200" in operation["responses"], (method, path)


def test_errors_and_auth_are_declared(document: dict[str, Any]) -> None:
    assert document["openapi"].startswith("3.1")
    schemes = document["components"]["securitySchemes"]
    assert schemes["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": schemes["bearer"]["description"],
    }
    for path, item in document["paths"].items():
        for method, op in item.items():
            health = path in ("/", "/health", "/ready", "/metrics")
            assert (op.get("security") is None) == health, (method, path)
            if health:
                continue
            assert "401" in op["responses"], (method, path)
            error = op["responses"]["401"]["content"]["application/json"]["schema"]["$ref"]
            expected = "WorkersAIError" if path.startswith("/client/v4") else "OpenAIError"
            if path.startswith("/v1/messages"):
                expected = "AnthropicError"
                assert {"x-api-key": []} in op["security"], path
            assert error == f"#/components/schemas/{expected}"


def test_request_bodies_are_the_validating_structs(document: dict[str, Any]) -> None:
    def body(path: str) -> Any:
        content = document["paths"][path]["post"]["requestBody"]["content"]
        return content["application/json"]["schema"]

    assert body("/v1/chat/completions") == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    chat = document["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["properties"]["temperature"]["anyOf"][0] == {
        "type": "number",
        "minimum": 0.0,
        "maximum": 2.0,
    }
    run = body("/client/v4/accounts/{account_id}/ai/run/{model}")
    names = {ref["$ref"].rsplit("/", 1)[1] for ref in run["anyOf"]}
    assert {"TextGenerationInput", "QueuedBatch", "PollRequest"} <= names

    # An id is one path segment; a model (an alias such as @cf/test/tiny) may hold `/`.
    def path_schema(path: str, name: str) -> Any:
        params = document["paths"][path]["get"]["parameters"]
        return next(p["schema"] for p in params if p["in"] == "path" and p["name"] == name)

    assert path_schema("/v1/files/{file_id}", "file_id")["pattern"] == "^[^/]+$"
    assert "pattern" not in path_schema("/v1/models/{model}", "model")
    # Stored records are answered without the gateway's own `tenant` field.
    assert "tenant" not in document["components"]["schemas"]["BatchObject"]["properties"]


def test_every_reference_resolves(document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]
    refs = set(re.findall(r'"\$ref": ?"#/components/schemas/([^"]+)"', _dumps(document)))
    assert refs and refs <= set(schemas)


def test_schemathesis_loads_every_operation(document: dict[str, Any]) -> None:
    schema = schemathesis.openapi.from_dict(document)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == sum(len(item) for item in document["paths"].values())


def test_docs_page_and_assets_are_local(client: TestClient[Litestar]) -> None:
    page = client.get("/docs")
    assert page.status_code == 200
    assert "text/html" in page.headers["content-type"]
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert assets and all(a.startswith("/docs/") for a in assets)  # no CDN
    for asset in [*assets, "/docs/init.js", "/docs/LICENSE"]:
        assert client.get(asset).status_code == 200, asset
    assert "/openapi.json" in client.get("/docs/init.js").text
    assert client.get("/docs/nothing-here.js").status_code == 404


def _dumps(value: Any) -> str:
    return json.dumps(value)


def test_shipped_ui_has_its_licence() -> None:
    folder = Path(__file__).resolve().parents[3] / "server" / "apidoc" / "docs"
    assert "Apache License" in (folder / "LICENSE").read_text()
