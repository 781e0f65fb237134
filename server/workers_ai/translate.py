"""OpenAI ↔ Workers AI: a Workers-AI input as an OpenAI request, an OpenAI answer (JSON or
event stream) as a Workers-AI result."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable
from typing import Any

import orjson

from backends.local.classifier import label_names
from backends.registry import ModelInfo
from foundation.sse import DONE, DONE_EVENT, SSEReader, event
from semcache.replay import merge_tool_call
from server.batch.results import USAGE_KEYS
from server.errors import ApiError, relayed_error
from server.http.reply import Reply
from server.serving.output_limit import NOTE_KEYS
from server.workers_ai.protocol import EmbeddingInput, TextGenerationInput

_OPENAI_SAMPLING = (
    "top_p",
    "top_k",
    "seed",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "response_format",
    "stop",
)

# -- Workers AI → OpenAI -----------------------------------------------------------------


def openai_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Workers AI accepts ``{name, description, parameters}`` as well as OpenAI's form."""
    out: list[dict[str, Any]] = []
    for tool in tools:
        if "function" in tool:
            out.append(tool)
        else:
            out.append({"type": "function", "function": tool})
    return out


def openai_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    """A named function as ``{"type": "function", "name": ...}`` too, as in OpenAI's
    Responses API; anything else as OpenAI's chat completions take it."""
    if (
        isinstance(choice, dict)
        and "function" not in choice
        and isinstance(choice.get("name"), str)
    ):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def text_request(info: ModelInfo, inp: TextGenerationInput) -> tuple[str, dict[str, Any]]:
    """The OpenAI route (``chat`` or ``completions``) and body of a text-generation input."""
    if inp.lora is not None:
        raise ApiError(405, f"The model {info.id} does not support LoRa inference", code="lora")
    if (inp.prompt is None) == (inp.messages is None):
        raise ApiError(400, "Send exactly one of `prompt` and `messages`.", code="invalid_value")
    body: dict[str, Any] = {"model": info.id, "temperature": inp.temperature}
    if inp.max_tokens is not None:  # else the policy's default, or Workers AI's (256)
        body["max_tokens"] = inp.max_tokens
    for name in _OPENAI_SAMPLING:
        value = getattr(inp, name)
        if value is not None:
            body[name] = value
    if inp.messages is not None:
        body["messages"] = inp.messages
        if inp.tools:
            body["tools"] = openai_tools(inp.tools)
            if inp.tool_choice is not None:
                body["tool_choice"] = openai_tool_choice(inp.tool_choice)
        return "chat", body
    if inp.raw:
        body["prompt"] = inp.prompt
        return "completions", body
    body["messages"] = [{"role": "user", "content": inp.prompt}]
    return "chat", body


def embedding_request(info: ModelInfo, inp: EmbeddingInput) -> dict[str, Any]:
    """The ``/v1/embeddings`` body of an embedding input (mean pooling only)."""
    if inp.pooling != "mean":
        raise ApiError(
            400,
            f"The model {info.id} only supports mean pooling.",
            param="pooling",
            code="invalid_value",
        )
    texts = [inp.text] if isinstance(inp.text, str) else list(inp.text)
    return {"model": info.id, "input": texts}


# -- OpenAI → Workers AI -----------------------------------------------------------------


def workers_usage(usage: Any) -> dict[str, Any]:
    usage = usage if isinstance(usage, dict) else {}
    out: dict[str, Any] = {k: int(usage.get(k) or 0) for k in USAGE_KEYS}
    if not out["total_tokens"]:
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    out.update({k: usage[k] for k in NOTE_KEYS if k in usage})  # what the gateway applied
    return out


def upstream_error(reply: Reply) -> ApiError:
    """An OpenAI/vLLM error answer as an ApiError with the same status and message."""
    return relayed_error(reply.status, reply.body)


def workers_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for call in calls:
        fn = call.get("function") or {}
        args: Any = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = orjson.loads(args)
            except orjson.JSONDecodeError:
                pass
        out.append({"name": fn.get("name"), "arguments": args})
    return out


def text_result(route: str, body: bytes) -> dict[str, Any]:
    """An OpenAI completion (chat or text) as a Workers-AI text-generation result."""
    answer = orjson.loads(body)
    choices = answer.get("choices") or [{}]
    first = choices[0]
    if route == "chat":
        message = first.get("message") or {}
        result: dict[str, Any] = {"response": message.get("content") or ""}
        if message.get("tool_calls"):
            result["tool_calls"] = workers_tool_calls(message["tool_calls"])
    else:
        result = {"response": first.get("text") or ""}
    result["usage"] = workers_usage(answer.get("usage"))
    return result


def embedding_result(body: bytes) -> dict[str, Any]:
    """An OpenAI embeddings answer as a Workers-AI embedding result."""
    answer = orjson.loads(body)
    rows = sorted(answer.get("data") or [], key=lambda d: d.get("index", 0))
    data = [row["embedding"] for row in rows]
    return {
        "shape": [len(data), len(data[0]) if data else 0],
        "data": data,
        "pooling": "mean",
        "usage": workers_usage(answer.get("usage")),
    }


def classification_result(body: bytes, labels: list[str]) -> list[dict[str, Any]]:
    """A one-text ``/v1/classify`` answer as Workers AI's labels and scores, best first."""
    (row,) = orjson.loads(body)["data"]
    names = label_names(labels, len(row["probs"]))
    scored = sorted(zip(names, row["probs"], strict=True), key=lambda p: -p[1])
    return [{"label": label, "score": score} for label, score in scored]


def rerank_result(scores: list[float], tokens: list[int], top_k: int | None = None) -> bytes:
    """Scores (one per context, in order) as Workers AI's reranker answers them: each
    context's index and score, best first (the ``top_k`` best); the usage beside."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:top_k]
    total = sum(tokens)
    usage = {"prompt_tokens": total, "completion_tokens": 0, "total_tokens": total}
    return orjson.dumps(
        {"response": [{"id": i, "score": scores[i]} for i in order], "usage": usage}
    )


async def workers_stream(source: AsyncIterable[bytes]) -> AsyncGenerator[bytes, None]:
    """OpenAI SSE chunks → Workers-AI events: ``{"response": piece}``…, the tool calls once
    complete (``{"response": "", "tool_calls": [...]}``), usage, ``[DONE]``.

    An error event of the source ends the stream with ``{"errors": [...]}`` and no
    ``[DONE]``, so a client can tell a cut answer from a complete one.
    """
    reader = SSEReader()
    usage: dict[str, Any] | None = None
    calls: dict[int, dict[str, Any]] = {}
    async for chunk in source:
        for payload in reader.feed(chunk):
            if payload == DONE:
                if calls:
                    merged = [calls[i] for i in sorted(calls)]
                    tools = {"response": "", "tool_calls": workers_tool_calls(merged)}
                    yield event(orjson.dumps(tools))
                yield event(orjson.dumps({"response": "", "usage": usage or workers_usage(None)}))
                yield DONE_EVENT
                return
            try:
                data = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(data, dict):
                continue
            if isinstance(data.get("error"), dict):
                err = data["error"]
                message = err.get("message") or "The model failed mid-answer."
                yield event(orjson.dumps({"errors": [{"code": 5020, "message": message}]}))
                return
            if data.get("usage"):
                usage = workers_usage(data["usage"])
            for choice in data.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = delta.get("content") if "delta" in choice else choice.get("text")
                if piece:
                    yield event(orjson.dumps({"response": piece}))
                for call in delta.get("tool_calls") or ():
                    merge_tool_call(calls, call)
    message = "The model ended the answer early."
    yield event(orjson.dumps({"errors": [{"code": 5020, "message": message}]}))
