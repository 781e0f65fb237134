"""The GET forms of ``/v1/embeddings`` and ``/v1/classify``: a query string → the body the
POST form takes, so both forms share one serving path and one cache key.

``?model=M&input=T`` with ``input`` repeated for a list (in order); embeddings also take
``encoding_format`` and ``dimensions``, both routes ``user``. The query is UTF-8,
percent-encoded as HTML forms do (``application/x-www-form-urlencoded``: ``+`` or ``%20`` is a
space, ``%2B`` a plus, ``%26`` an ampersand). One ``input`` becomes a string, several a list
(the cache key treats a one-item list and a string alike).

Limits: a query string of at most ``MAX_QUERY_BYTES`` (longer: 414, send a POST instead);
an unknown or repeated parameter, a missing ``model`` or ``input``, or bytes that are not
percent-encoded UTF-8: 400 naming the parameter.
"""

from __future__ import annotations

from typing import Any, Final
from urllib.parse import parse_qsl

from server.errors import ApiError

MAX_QUERY_BYTES: Final = 8192
"""Longest query string a GET form takes (bytes, percent-encoded)."""
MAX_QUERY_FIELDS: Final = 2048 + 8
"""Most ``name=value`` pairs read (the POST form's item limit plus the other fields)."""

FIELDS: Final[dict[str, frozenset[str]]] = {
    "embeddings": frozenset({"model", "input", "encoding_format", "dimensions", "user"}),
    "classification": frozenset({"model", "input", "user"}),
}


def _pairs(raw: bytes) -> list[tuple[str, str]]:
    if len(raw) > MAX_QUERY_BYTES:
        raise ApiError(
            414,
            f"The query string is {len(raw)} bytes; a GET takes at most {MAX_QUERY_BYTES}. "
            "Send the request as a POST with a JSON body instead.",
            code="uri_too_long",
        )
    try:
        text = raw.decode("ascii")
        return parse_qsl(
            text,
            keep_blank_values=True,
            strict_parsing=False,
            encoding="utf-8",
            errors="strict",
            max_num_fields=MAX_QUERY_FIELDS,
        )
    except UnicodeDecodeError:
        raise ApiError(
            400, "The query string must be percent-encoded UTF-8.", code="invalid_query"
        ) from None
    except ValueError:
        raise ApiError(
            400, f"Too many query parameters (at most {MAX_QUERY_FIELDS}).", code="invalid_query"
        ) from None


def query_body(raw: bytes, route: str) -> dict[str, Any]:
    """The JSON body equal to a GET form's query string ``raw`` (``embeddings`` or
    ``classification``)."""
    allowed = FIELDS[route]
    inputs: list[str] = []
    body: dict[str, Any] = {}
    for name, value in _pairs(raw):
        if name not in allowed:
            raise ApiError(
                400,
                f"Unknown query parameter `{name}`; this route takes "
                + ", ".join(sorted(allowed))
                + ".",
                param=name,
                code="unknown_parameter",
            )
        if name == "input":
            inputs.append(value)
            continue
        if name in body:
            raise ApiError(
                400, f"The query parameter `{name}` is repeated.", param=name, code="invalid_value"
            )
        body[name] = value
    missing = [n for n, there in (("model", "model" in body), ("input", bool(inputs))) if not there]
    if missing:
        raise ApiError(
            400,
            f"Missing query parameter `{missing[0]}`.",
            param=missing[0],
            code="missing_required_parameter",
        )
    body["input"] = inputs[0] if len(inputs) == 1 else inputs
    if "dimensions" in body:
        try:
            body["dimensions"] = int(body["dimensions"])
        except ValueError:
            raise ApiError(
                400, "`dimensions` must be an integer.", param="dimensions", code="invalid_value"
            ) from None
    return body
