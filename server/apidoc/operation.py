"""What a route declares for the OpenAPI document: its request body, query parameters and
every answer it can give, as msgspec types.

Routes read their raw body and validate it themselves (one orjson parse, one
``msgspec.convert``), so Litestar cannot see the body's type; each route names it instead, with
``operation_class=documented(RouteDoc(...))`` on its decorator. Schemas come from
``msgspec.json.schema_components``, from the same types that validate requests and encode
answers, so the document cannot drift from the code. The components those schemas refer to
are added by ``server.apidoc.document``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, ClassVar

import msgspec
from litestar.openapi.spec import (
    Link,
    OpenAPIHeader,
    OpenAPIMediaType,
    OpenAPIResponse,
    Operation,
    Parameter,
    RequestBody,
    Schema,
)

REF_TEMPLATE = "#/components/schemas/{name}"
BEARER = "bearer"
"""The name of the security scheme: ``Authorization: Bearer <token>``."""
ERROR_PLACEHOLDER = "SurfaceError"
"""What an operation's error answers refer to until the document is rendered: the error
model of the surface that owns its path (``server/apidoc/document.py``)."""

CLIENT_ERRORS = (400, 401, 413, 429)
"""What any API route with a body can answer: bad input, no token, too large, rate limited."""
SERVER_ERROR = (500,)
"""A bug in the gateway (never a stack trace)."""
BACKEND_ERRORS = (502, 503, 504)
"""The backend failed, is unavailable (or all its servers are), or timed out."""
NONSTANDARD = {529: "Overloaded"}
"""Statuses outside RFC 9110 that an API answers with (Anthropic's 529)."""


SSE_EVENT = {
    "type": "object",
    "description": "One server-sent event: a JSON chunk in `data` (`[DONE]` ends a /v1 stream), "
    "named by `event` on /v1/responses.",
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}
"""What OpenAPI 3.1's ``schema`` of ``text/event-stream`` describes: each event."""


@dataclass(frozen=True)
class Public:
    """A stored record as the API answers it: every field but the gateway's own ``tenant``
    (``server.openai.protocol.public``)."""

    type: type


@dataclass(frozen=True)
class AnyOf:
    """One of several shapes (a union msgspec cannot express: several untagged structs)."""

    members: tuple[Any, ...]


@dataclass(frozen=True)
class Field:
    """A query parameter or a request header."""

    name: str
    schema: Any
    description: str
    required: bool = False


@dataclass(frozen=True)
class Answer:
    """A successful answer: its status, its JSON schema, and other media types it may take."""

    status: int
    schema: Any
    """``None``: no body (a 304)."""
    description: str
    media_type: str = "application/json"
    also: tuple[str, ...] = ()
    """Other media types of the same answer (``text/event-stream`` when streamed)."""
    headers: tuple[str, ...] = ()
    links: Mapping[str, Link] = field(default_factory=dict)
    """Operations that take a value of this answer (``$response.body#/id``): what a client
    does next, and what a stateful fuzzer chains."""


@dataclass(frozen=True)
class RouteDoc:
    """Everything the document says of one operation."""

    summary: str
    tag: str
    answers: tuple[Answer, ...]
    errors: tuple[int, ...]
    """Every error status the route can answer with (in its surface's error format)."""
    body: Any = None
    """The JSON request body's type; ``None``: no body."""
    body_media_type: str = "application/json"
    query: tuple[Field, ...] = ()
    headers: tuple[Field, ...] = ()
    auth: bool = True
    description: str | None = None

    def leaves(self) -> Iterator[Any]:
        """Every type the operation's schemas name (the components the document needs; the
        error models are the surfaces')."""
        roots = [self.body, *(a.schema for a in self.answers)]
        roots += [f.schema for f in (*self.query, *self.headers)]
        for root in roots:
            yield from _leaves(root)


def _leaves(value: Any) -> Iterator[Any]:
    if value is None or isinstance(value, str | int | float | bool):
        return
    if isinstance(value, dict | list):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _leaves(item)
    elif isinstance(value, AnyOf):
        for member in value.members:
            yield from _leaves(member)
    elif isinstance(value, Public):
        yield value.type
    else:
        yield value


def query_fields(struct: type[msgspec.Struct]) -> tuple[Field, ...]:
    """A query string validated as ``struct`` (``msgspec.convert(..., strict=False)``): one
    parameter per field, with the field's schema."""
    _, components = msgspec.json.schema_components([struct], ref_template=REF_TEMPLATE)
    schema = components[struct.__name__]
    required = set(schema.get("required", ()))
    return tuple(
        Field(name, prop, prop.get("description", f"`{name}`"), name in required)
        for name, prop in schema["properties"].items()
    )


def schema_of(value: Any) -> dict[str, Any]:
    """The JSON schema of a type (components by reference), an ``AnyOf``, or a plain schema
    whose values may be any of these."""
    if isinstance(value, dict):
        return {k: _resolve(v) for k, v in value.items()}
    if isinstance(value, AnyOf):
        return {"anyOf": [schema_of(m) for m in value.members]}
    if isinstance(value, Public):
        value = value.type
    (schema,), _ = msgspec.json.schema_components([value], ref_template=REF_TEMPLATE)
    return schema


def _resolve(value: Any) -> Any:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list):
        return [_resolve(v) for v in value]
    return schema_of(value)


def _schema(value: Any) -> Schema:
    # Litestar serialises the document by walking it; a plain dict passes through unchanged.
    schema: Schema = schema_of(value)  # type: ignore[assignment]
    return schema


def _error_response(status: int) -> OpenAPIResponse:
    headers = None
    if status in (429, 503):
        headers = {
            "Retry-After": OpenAPIHeader(
                schema=_schema({"type": "string"}),
                description="Seconds to wait before trying again (when known).",
            )
        }
    phrase = NONSTANDARD.get(status) or HTTPStatus(status).phrase
    return OpenAPIResponse(
        description=phrase,
        content={
            "application/json": OpenAPIMediaType(
                schema={"$ref": REF_TEMPLATE.format(name=ERROR_PLACEHOLDER)}  # type: ignore[arg-type]
            )
        },
        headers=headers,  # type: ignore[arg-type]
    )


def _answer_response(answer: Answer) -> OpenAPIResponse:
    content: dict[str, OpenAPIMediaType] = {}
    if answer.schema is not None:
        content[answer.media_type] = OpenAPIMediaType(schema=_schema(answer.schema))
    for media_type in answer.also:
        other = SSE_EVENT if media_type == "text/event-stream" else {"type": "string"}
        content[media_type] = OpenAPIMediaType(schema=_schema(other))
    headers = {name: OpenAPIHeader(schema=_schema({"type": "string"})) for name in answer.headers}
    return OpenAPIResponse(
        description=answer.description,
        content=content or None,
        headers=headers or None,  # type: ignore[arg-type]
        links=dict(answer.links) or None,
    )


def _parameter(field: Field, where: str) -> Parameter:
    return Parameter(
        name=field.name,
        param_in=where,
        schema=_schema(field.schema),
        description=field.description,
        required=field.required,
    )


@dataclass
class DocumentedOperation(Operation):
    """An operation whose body, parameters and answers come from its route's ``RouteDoc``
    (Litestar builds the rest: the path, its parameters, the operation id)."""

    doc: ClassVar[RouteDoc]

    def __post_init__(self) -> None:
        doc = self.doc
        self.summary = doc.summary
        self.description = doc.description
        self.tags = [doc.tag]
        # The surface's own key schemes join at render (``server/apidoc/document.py``).
        self.security = [{BEARER: []}] if doc.auth else None
        params = list(self.parameters or [])
        params += [_parameter(f, "query") for f in doc.query]
        params += [_parameter(f, "header") for f in doc.headers]
        self.parameters = params or None
        self.request_body = None
        if doc.body is not None:
            media = OpenAPIMediaType(schema=_schema(doc.body))
            self.request_body = RequestBody(content={doc.body_media_type: media}, required=True)
        responses = {str(a.status): _answer_response(a) for a in doc.answers}
        for status in doc.errors:
            responses[str(status)] = _error_response(status)
        self.responses = responses  # type: ignore[assignment]


def documented(doc: RouteDoc) -> type[DocumentedOperation]:
    """The ``operation_class`` of a route described by ``doc``."""
    return type("DocumentedOperation", (DocumentedOperation,), {"doc": doc})
