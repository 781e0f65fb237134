"""``/openapi.json`` (OpenAPI 3.1) and the docs UI at ``/docs``.

Litestar builds the document from the route handlers: paths, path parameters, operation ids,
and each operation's ``DocumentedOperation`` (``server.apidoc.operation``) fills in its body,
query, headers and answers. The components those refer to are msgspec's schemas of the same
types (``msgspec.json.schema_components``); Litestar fills ``components.schemas`` from its own
schema registry, so the JSON render plugin here adds ours as it renders.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import msgspec
import orjson
from litestar import Request, Router
from litestar.handlers import HTTPRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.openapi.spec import Components, SecurityScheme
from litestar.static_files import create_static_files_router

from foundation.package_files import package_file
from server.apidoc.operation import (
    BEARER,
    ERROR_PLACEHOLDER,
    REF_TEMPLATE,
    DocumentedOperation,
    Public,
    RouteDoc,
)
from server.errors import OpenAIError
from server.surface import Surface, Surfaces

DOCUMENT_PATH = "/openapi.json"
DOCS_PATH = "/docs"
PUBLIC = {"auth": "public"}
"""No token needed (``server.envelope.middleware``)."""

DESCRIPTION = """\
An OpenAI-compatible gateway with exact and semantic caching in front of vLLM, and
Cloudflare's Workers AI REST API on the same models and caches.

Each API answers errors in its own shape: OpenAI's `{"error": {...}}` on `/v1` and `/admin`,
Anthropic's on `/v1/messages`, Cloudflare's envelope with `success: false` on `/client/v4`.
API routes take `Authorization: Bearer <token>` (see docs/tenants.md), some also their API's
own key header; `/health`, `/ready` and `/metrics` take none.
"""


def route_docs(handlers: Iterable[HTTPRouteHandler]) -> list[RouteDoc]:
    """The ``RouteDoc`` of every documented handler."""
    docs: list[RouteDoc] = []
    for handler in handlers:
        cls = handler.operation_class
        if isinstance(cls, type) and issubclass(cls, DocumentedOperation):
            docs.append(cls.doc)
    return docs


def components_of(docs: Iterable[RouteDoc], error_models: Iterable[type] = ()) -> dict[str, Any]:
    """msgspec's schemas of every type the operations name and of the surfaces' error
    models, by name (``REF_TEMPLATE``)."""
    types: dict[str, Any] = {}
    public: set[str] = set()
    docs = list(docs)
    error_models = list(dict.fromkeys(error_models))
    for model in error_models:
        types[model.__name__] = model
    for doc in docs:
        roots = [doc.body, *(a.schema for a in doc.answers)]
        public |= {r.type.__name__ for r in roots if isinstance(r, Public)}
        for leaf in doc.leaves():
            name = getattr(leaf, "__name__", None)
            if isinstance(leaf, type) and issubclass(leaf, msgspec.Struct) and name is not None:
                if types.setdefault(name, leaf) is not leaf:
                    raise ValueError(f"two schemas are named {name}: {leaf} and {types[name]}")
    leaves = [*error_models, *(leaf for doc in docs for leaf in doc.leaves())]
    _, components = msgspec.json.schema_components(leaves, ref_template=REF_TEMPLATE)
    for name in public:
        schema = components[name]
        schema["properties"].pop("tenant", None)
        schema["required"] = [f for f in schema.get("required", []) if f != "tenant"]
    return components


SEGMENT = {"type": "string", "minLength": 1, "pattern": "^[^/]+$"}
"""A ``{name:str}`` path parameter: one path segment (a ``{name:path}`` one may hold ``/``)."""


def segment_parameters(handlers: Iterable[HTTPRouteHandler]) -> dict[str, set[str]]:
    """The ``{name:str}`` parameters of each documented path (as the document spells it)."""
    found: dict[str, set[str]] = {}
    for handler in handlers:
        for path in handler.paths:
            spelled = re.sub(r"\{(\w+):\w+\}", r"{\1}", path)
            found.setdefault(spelled, set()).update(re.findall(r"\{(\w+):str\}", path))
    return found


class DocumentWithComponents(JsonRenderPlugin):
    """Renders Litestar's document with our components added, once."""

    def __init__(
        self,
        components: dict[str, Any],
        segments: dict[str, set[str]],
        surfaces: Surfaces,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.components = components
        self.segments = segments
        self.surfaces = surfaces
        self._rendered: bytes | None = None

    def render(self, request: Request[Any, Any, Any], openapi_schema: dict[str, Any]) -> bytes:
        if self._rendered is None:
            document = copy.deepcopy(openapi_schema)
            components = dict(document.get("components") or {})
            components["schemas"] = {**(components.get("schemas") or {}), **self.components}
            document["components"] = components
            for path, item in document.get("paths", {}).items():
                surface = self.surfaces.of(path)
                for operation in item.values():
                    for param in operation.get("parameters") or ():
                        if param["in"] == "path" and param["name"] in self.segments.get(path, ()):
                            param["schema"] = SEGMENT
                    own_errors(operation, surface)
            self._rendered = orjson.dumps(document)
        return self._rendered


def own_errors(operation: dict[str, Any], surface: Surface | None) -> None:
    """An operation's error answers in its surface's error model, and its surface's key
    schemes beside the bearer token."""
    model = (surface.errors.model if surface is not None else OpenAIError).__name__
    placeholder = REF_TEMPLATE.format(name=ERROR_PLACEHOLDER)
    for answer in (operation.get("responses") or {}).values():
        for media in (answer.get("content") or {}).values():
            if media.get("schema") == {"$ref": placeholder}:
                media["schema"] = {"$ref": REF_TEMPLATE.format(name=model)}
    if operation.get("security") and surface is not None:
        operation["security"] += [{name: []} for name in key_schemes(surface)]


def key_schemes(surface: Surface) -> dict[str, SecurityScheme]:
    """The security schemes of a surface's own key headers and query parameters."""
    where = ", ".join(f"`{p}`" for p in surface.prefixes)
    said = f"The same API token, as {surface.name}'s clients send it ({where} only)."
    schemes = {
        name: SecurityScheme(
            type="apiKey", name=name, security_scheme_in="header", description=said
        )
        for name in surface.key_headers
    }
    for name in surface.key_query:
        schemes[f"query-{name}"] = SecurityScheme(
            type="apiKey", name=name, security_scheme_in="query", description=said
        )
    return schemes


def operation_id(handler: HTTPRouteHandler, method: Any, path: list[Any]) -> str:
    """A route's operation id: its handler's name (``create_batch``), unique in the app."""
    return handler.handler_name


def _version() -> str:
    try:
        return version("semcache")
    except PackageNotFoundError:
        return "0.0.0"


def openapi_config(surfaces: Surfaces) -> OpenAPIConfig:
    """The app's OpenAPI config: ``/openapi.json``, from the routes' ``RouteDoc`` and the
    surfaces' error models and key schemes."""
    handlers = [h for h in surfaces.routes() if isinstance(h, HTTPRouteHandler)]
    models = [OpenAIError, *(s.errors.model for s in surfaces.all)]
    components = components_of(route_docs(handlers), models)
    # The router's own path is the document: Litestar's catch-all for unknown schema pages
    # then lives under /openapi.json/…, not at the root beside the API routes.
    plugin = DocumentWithComponents(
        components, segment_parameters(handlers), surfaces, path=["/", DOCUMENT_PATH]
    )
    schemes: dict[str, SecurityScheme] = {
        BEARER: SecurityScheme(
            type="http",
            scheme="bearer",
            description="An API token; `/admin` needs one with the admin role.",
        )
    }
    for surface in surfaces.all:
        schemes.update(key_schemes(surface))
    # The document is public, like the docs UI: it says nothing a client could not try.
    router = Router(DOCUMENT_PATH, route_handlers=[], include_in_schema=False, opt=PUBLIC)
    return OpenAPIConfig(
        title="Semcache",
        version=_version(),
        description=DESCRIPTION,
        openapi_router=router,
        render_plugins=[plugin],
        operation_id_creator=operation_id,
        components=Components(security_schemes=schemes),  # type: ignore[arg-type]
    )


def docs_router() -> Router:
    """``/docs``: Swagger UI on ``/openapi.json``, its assets served from the package."""
    return create_static_files_router(
        path=DOCS_PATH,
        directories=[package_file("server", "apidoc", "docs")],
        html_mode=True,
        name="docs",
        include_in_schema=False,
        opt=PUBLIC,
    )
