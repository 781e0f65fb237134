"""Replay a cached answer in the shape the request asks for, whichever shape populated it.

* A stored stream → one ``chat.completion`` / ``text_completion`` JSON object, assembled from
  the chunks (role, content, reasoning, tool-call deltas, logprobs, finish reason, usage).
* A stored JSON answer → OpenAI chunk payloads: a role chunk, the content chunk(s), a finish
  chunk per choice, and the usage chunk when ``stream_options.include_usage`` is set.
* A stored stream → the same chunks, with the usage chunk kept or dropped per the request.
* A stored Responses API stream → its event blocks as they arrived, or (as JSON) the response
  of its ``response.completed`` event. Its JSON answers are cached under other keys
  (``semcache.cache_keys``) and are never turned into a stream.

Payloads are the bytes after ``data: ``; framing and ``[DONE]`` belong to ``foundation.sse``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from foundation.sse import parse_block
from semcache.entry import CachedAnswer, Usage

_OBJECT = {"chat": "chat.completion", "completions": "text_completion"}
_CHUNK_OBJECT = {"chat": "chat.completion.chunk", "completions": "text_completion"}


class ReplayError(ValueError):
    """The stored answer cannot be replayed in the requested shape (e.g. a stream of embeddings)."""


def wants_usage(body: Mapping[str, Any]) -> bool:
    """Whether a streaming request asked for the usage chunk (``stream_options.include_usage``)."""
    opts = body.get("stream_options")
    return isinstance(opts, Mapping) and bool(opts.get("include_usage"))


def _usage_dict(u: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def _is_usage_chunk(doc: Mapping[str, Any]) -> bool:
    return not doc.get("choices") and doc.get("usage") is not None


def is_usage_only(payload: bytes) -> bool:
    """True for the final usage chunk of a stream (no choices, a usage object)."""
    if b'"usage"' not in payload:
        return False  # the common case: decided without parsing
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return False
    return isinstance(doc, dict) and _is_usage_chunk(doc)


# --------------------------------------------------------------------------- stream → JSON


def merge_tool_call(calls: dict[int, dict[str, Any]], delta: Mapping[str, Any]) -> None:
    """Add one streamed tool-call delta to the calls assembled so far (by their index)."""
    idx = delta.get("index", len(calls))
    call = calls.setdefault(
        idx, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
    )
    if delta.get("id"):
        call["id"] = delta["id"]
    if delta.get("type"):
        call["type"] = delta["type"]
    fn = delta.get("function") or {}
    if fn.get("name"):
        call["function"]["name"] += fn["name"]
    if fn.get("arguments"):
        call["function"]["arguments"] += fn["arguments"]


def assemble_stream(route: str, chunks: list[bytes], usage: Usage | None = None) -> bytes:
    """One non-stream JSON answer from the chunk payloads of a stream."""
    if route not in _OBJECT:
        raise ReplayError(f"route {route!r} has no streaming form")
    head: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    usage_doc: Any = None
    for raw in chunks:
        doc = orjson.loads(raw)
        if not head:
            head = {k: doc.get(k) for k in ("id", "created", "model")}
            if doc.get("system_fingerprint") is not None:
                head["system_fingerprint"] = doc["system_fingerprint"]
        if doc.get("usage") is not None:
            usage_doc = doc["usage"]
        for ch in doc.get("choices") or ():
            idx = ch.get("index", 0)
            acc = choices.setdefault(
                idx,
                {
                    "role": None,
                    "content": None,
                    "reasoning": None,
                    "tools": {},
                    "logprobs": None,
                    "finish_reason": None,
                    "stop_reason": None,
                    "text": "",
                    "has_logprobs": False,
                },
            )
            if ch.get("finish_reason") is not None:
                acc["finish_reason"] = ch["finish_reason"]
            if ch.get("stop_reason") is not None:
                acc["stop_reason"] = ch["stop_reason"]
            lp = ch.get("logprobs")
            if route == "chat":
                delta = ch.get("delta") or {}
                if delta.get("role"):
                    acc["role"] = delta["role"]
                if delta.get("content") is not None:
                    acc["content"] = (acc["content"] or "") + delta["content"]
                for rk in ("reasoning_content", "reasoning"):
                    if delta.get(rk):
                        acc["reasoning"] = (acc["reasoning"] or "") + delta[rk]
                for tc in delta.get("tool_calls") or ():
                    merge_tool_call(acc["tools"], tc)
                if isinstance(lp, Mapping) and lp.get("content"):
                    acc["has_logprobs"] = True
                    acc["logprobs"] = (acc["logprobs"] or []) + list(lp["content"])
            else:
                acc["text"] += ch.get("text") or ""
                if isinstance(lp, Mapping):
                    acc["has_logprobs"] = True
                    merged = acc["logprobs"] or {
                        "tokens": [],
                        "token_logprobs": [],
                        "top_logprobs": [],
                        "text_offset": [],
                    }
                    for k in merged:
                        merged[k] = merged[k] + list(lp.get(k) or [])
                    acc["logprobs"] = merged

    out_choices: list[dict[str, Any]] = []
    for idx in sorted(choices):
        acc = choices[idx]
        if route == "chat":
            content = acc["content"]
            if acc["tools"] and not content:
                content = None  # a tool-call answer has no content, as in the non-stream form
            msg: dict[str, Any] = {"role": acc["role"] or "assistant", "content": content}
            if acc["reasoning"] is not None:
                msg["reasoning_content"] = acc["reasoning"]
            if acc["tools"]:
                msg["tool_calls"] = [acc["tools"][i] for i in sorted(acc["tools"])]
            choice: dict[str, Any] = {
                "index": idx,
                "message": msg,
                "logprobs": {"content": acc["logprobs"]} if acc["has_logprobs"] else None,
                "finish_reason": acc["finish_reason"],
            }
        else:
            choice = {
                "index": idx,
                "text": acc["text"],
                "logprobs": acc["logprobs"] if acc["has_logprobs"] else None,
                "finish_reason": acc["finish_reason"],
            }
        if acc["stop_reason"] is not None:
            choice["stop_reason"] = acc["stop_reason"]
        out_choices.append(choice)

    out: dict[str, Any] = {
        "id": head.get("id"),
        "object": _OBJECT[route],
        "created": head.get("created"),
        "model": head.get("model"),
        "choices": out_choices,
    }
    if "system_fingerprint" in head:
        out["system_fingerprint"] = head["system_fingerprint"]
    if usage_doc is not None:
        out["usage"] = usage_doc
    elif usage is not None and (usage.prompt_tokens or usage.completion_tokens):
        out["usage"] = _usage_dict(usage)
    return orjson.dumps(out)


# --------------------------------------------------------------------------- JSON → stream


def _chunk(head: Mapping[str, Any], route: str, choice: dict[str, Any]) -> bytes:
    doc = {**head, "object": _CHUNK_OBJECT[route], "choices": [choice]}
    return orjson.dumps(doc)


def split_json(route: str, body: bytes, *, include_usage: bool) -> list[bytes]:
    """OpenAI chunk payloads equivalent to one non-stream JSON answer."""
    if route not in _OBJECT:
        raise ReplayError(f"route {route!r} has no streaming form")
    doc = orjson.loads(body)
    head: dict[str, Any] = {
        "id": doc.get("id"),
        "created": doc.get("created"),
        "model": doc.get("model"),
    }
    if doc.get("system_fingerprint") is not None:
        head["system_fingerprint"] = doc["system_fingerprint"]
    out: list[bytes] = []
    for ch in doc.get("choices") or ():
        idx = ch.get("index", 0)
        extra = {"stop_reason": ch["stop_reason"]} if "stop_reason" in ch else {}
        if route == "chat":
            msg = ch.get("message") or {}
            out.append(
                _chunk(
                    head,
                    route,
                    {
                        "index": idx,
                        "delta": {"role": msg.get("role", "assistant"), "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    },
                )
            )
            reasoning = msg.get("reasoning_content") or msg.get("reasoning")
            if reasoning:
                out.append(
                    _chunk(
                        head,
                        route,
                        {
                            "index": idx,
                            "delta": {"reasoning_content": reasoning},
                            "logprobs": None,
                            "finish_reason": None,
                        },
                    )
                )
            if msg.get("content"):
                lp = ch.get("logprobs")
                out.append(
                    _chunk(
                        head,
                        route,
                        {
                            "index": idx,
                            "delta": {"content": msg["content"]},
                            "logprobs": lp,
                            "finish_reason": None,
                        },
                    )
                )
            for i, tc in enumerate(msg.get("tool_calls") or ()):
                fn = tc.get("function") or {}
                out.append(
                    _chunk(
                        head,
                        route,
                        {
                            "index": idx,
                            "delta": {
                                "tool_calls": [
                                    {
                                        "index": i,
                                        "id": tc.get("id"),
                                        "type": tc.get("type", "function"),
                                        "function": {
                                            "name": fn.get("name"),
                                            "arguments": fn.get("arguments", ""),
                                        },
                                    }
                                ]
                            },
                            "logprobs": None,
                            "finish_reason": None,
                        },
                    )
                )
            out.append(
                _chunk(
                    head,
                    route,
                    {
                        "index": idx,
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": ch.get("finish_reason"),
                        **extra,
                    },
                )
            )
        else:
            if ch.get("text"):
                out.append(
                    _chunk(
                        head,
                        route,
                        {
                            "index": idx,
                            "text": ch["text"],
                            "logprobs": ch.get("logprobs"),
                            "finish_reason": None,
                        },
                    )
                )
            out.append(
                _chunk(
                    head,
                    route,
                    {
                        "index": idx,
                        "text": "",
                        "logprobs": None,
                        "finish_reason": ch.get("finish_reason"),
                        **extra,
                    },
                )
            )
    if include_usage and doc.get("usage") is not None:
        out.append(
            orjson.dumps(
                {**head, "object": _CHUNK_OBJECT[route], "choices": [], "usage": doc["usage"]}
            )
        )
    return out


def _restream(route: str, chunks: list[bytes], u: Usage, include_usage: bool) -> list[bytes]:
    out: list[bytes] = []
    had_usage = False
    head: dict[str, Any] = {}
    for raw in chunks:
        doc = orjson.loads(raw)
        if not head:
            head = {k: doc.get(k) for k in ("id", "created", "model")}
        if _is_usage_chunk(doc):
            had_usage = True
            if include_usage:
                out.append(raw)
            continue
        out.append(raw)
    if include_usage and not had_usage and (u.prompt_tokens or u.completion_tokens):
        out.append(
            orjson.dumps(
                {
                    **head,
                    "object": _CHUNK_OBJECT.get(route, "chunk"),
                    "choices": [],
                    "usage": _usage_dict(u),
                }
            )
        )
    return out


# --------------------------------------------------------------------------- entry points


def _completed_response(blocks: list[bytes]) -> bytes:
    """The response object of a Responses API stream's ``response.completed`` event."""
    _, data = parse_block(blocks[-1]) if blocks else (None, None)
    doc = orjson.loads(data) if data is not None else None
    if not isinstance(doc, dict) or not isinstance(doc.get("response"), dict):
        raise ReplayError("the stored Responses stream has no completed response")
    return orjson.dumps(doc["response"])


def as_json(answer: CachedAnswer, route: str) -> bytes:
    """The JSON body to send to a non-stream request."""
    if answer.body is not None:
        return answer.body
    if answer.chunks is None:
        raise ReplayError("answer has neither body nor chunks")
    if route == "responses":
        return _completed_response(answer.chunks)
    return assemble_stream(route, answer.chunks, answer.usage)


def as_stream(answer: CachedAnswer, route: str, *, include_usage: bool) -> list[bytes]:
    """The ``data:`` payloads to send to a ``stream=true`` request (``[DONE]`` not included);
    for the Responses API, the stored event blocks as they arrived."""
    if route == "responses":
        if answer.chunks is None:
            raise ReplayError("a Responses API JSON answer has no streaming form here")
        return answer.chunks
    if answer.chunks is not None:
        return _restream(route, answer.chunks, answer.usage, include_usage)
    if answer.body is None:
        raise ReplayError("answer has neither body nor chunks")
    return split_json(route, answer.body, include_usage=include_usage)
