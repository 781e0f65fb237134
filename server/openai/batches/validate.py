"""An input file's lines checked before anything is queued: every error, with its line."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from backends.registry import ModelRegistry
from server.identity.auth import model_allowed
from server.openai.batches.protocol import ENDPOINTS, BatchError, InputLine

MAX_ERRORS = 100
"""Errors reported per file (the first ones, by line)."""


@dataclass
class Checked:
    """The lines of a valid file, or the errors of an invalid one."""

    lines: list[InputLine] = field(default_factory=list)
    model: str | None = None
    errors: list[BatchError] = field(default_factory=list)


def check_input(
    data: bytes,
    *,
    batch_id: str,
    endpoint: str,
    registry: ModelRegistry,
    max_lines: int,
    models: frozenset[str] | None = None,
) -> Checked:
    """Check every line of ``data`` (JSONL of ``{custom_id, method, url, body}``): one model
    for the whole file (as OpenAI requires), the batch's endpoint, unique ``custom_id``s, and
    a model the submitting API key may use (``models``; ``None``: any)."""
    out = Checked()
    seen: set[str] = set()
    task = ENDPOINTS[endpoint]

    def fail(line: int | None, code: str, message: str, param: str | None = None) -> None:
        if len(out.errors) < MAX_ERRORS:
            out.errors.append(BatchError(code=code, message=message, line=line, param=param))

    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            item: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            fail(number, "invalid_json_line", f"Line {number} is not valid JSON.")
            continue
        if not isinstance(item, dict):
            fail(number, "invalid_request", f"Line {number} is not a JSON object.")
            continue
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            fail(
                number,
                "missing_required_parameter",
                "`custom_id` must be a non-empty string.",
                "custom_id",
            )
            continue
        if custom_id in seen:
            fail(
                number,
                "duplicate_custom_id",
                f"The custom_id `{custom_id}` is used by an earlier line.",
                "custom_id",
            )
            continue
        seen.add(custom_id)
        if item.get("method") != "POST":
            fail(number, "invalid_method", "`method` must be `POST`.", "method")
            continue
        url = item.get("url")
        if url not in ENDPOINTS:
            fail(
                number,
                "invalid_url",
                f"The url {url!r} is not one of " + ", ".join(ENDPOINTS) + ".",
                "url",
            )
            continue
        if url != endpoint:
            fail(
                number,
                "mismatched_endpoint",
                f"The url `{url}` does not match the batch's endpoint `{endpoint}`.",
                "url",
            )
            continue
        body = item.get("body")
        if not isinstance(body, dict):
            fail(number, "invalid_request", "`body` must be a JSON object.", "body")
            continue
        model = body.get("model")
        if not isinstance(model, str) or not model:
            fail(
                number, "missing_required_parameter", "`body.model` must be a string.", "body.model"
            )
            continue
        info = registry.resolve(model)
        if info is None:
            fail(
                number,
                "model_not_found",
                f"The model `{model}` does not exist or you do not have access to it.",
                "body.model",
            )
            continue
        if not model_allowed(models, model, info):
            fail(
                number,
                "model_not_allowed",
                f"This API key may not use the model `{model}`.",
                "body.model",
            )
            continue
        if info.task != task:
            fail(
                number,
                "invalid_model",
                f"The model `{model}` serves {info.task}, not `{endpoint}`.",
                "body.model",
            )
            continue
        if out.model is None:
            out.model = model
        elif registry.resolve(out.model) is not info:
            fail(
                number,
                "mismatched_model",
                "Every line of a batch must use the same model "
                f"(`{out.model}` on an earlier line, `{model}` here).",
                "body.model",
            )
            continue
        out.lines.append(
            InputLine(batch_id=batch_id, line=number, custom_id=custom_id, url=url, body=body)
        )
    if not out.lines and not out.errors:
        fail(None, "empty_file", "The input file has no requests.")
    if len(seen) > max_lines:
        fail(
            None,
            "too_many_requests",
            f"The input file has {len(seen)} requests; the limit is {max_lines} per batch.",
        )
    return out
