"""Anthropic ↔ OpenAI: a Messages request as the chat completion request it means, and a chat
completion (JSON) as a Messages answer. Streams are ``events.py``'s.

The request is translated as vLLM's own ``/v1/messages`` translates it (``vllm/entrypoints/
anthropic/serving.py``), so a model gets the same prompt through the gateway as from vLLM
directly: the system prompt (text blocks joined; Claude Code's per-request
``x-anthropic-billing-header`` block dropped, as it would defeat every cache), ``tool_use``
blocks as the assistant's ``tool_calls``, ``tool_result`` blocks as ``tool`` messages,
``tool_choice`` ``any`` as ``required`` and ``tool`` as a named function, ``stop_sequences``
as ``stop``, ``metadata.user_id`` as ``user``.
"""

from __future__ import annotations

import json
from typing import Any, Final

import orjson

from server.anthropic.protocol import (
    ImageBlock,
    Message,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    TokenCountRequest,
    ToolResultBlock,
    ToolUseBlock,
)
from server.errors import ApiError

BILLING_HEADER: Final = "x-anthropic-billing-header"
"""Claude Code's attribution block: a hash that changes with every request."""

# -- Anthropic → OpenAI ------------------------------------------------------------------


def chat_messages(req: TokenCountRequest) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages."""
    out: list[dict[str, Any]] = []
    system = _system_text(req.system)
    if system:
        out.append({"role": "system", "content": system})
    for message in req.messages:
        _append(message, out)
    return out


def _system_text(system: str | list[TextBlock] | None) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    return "".join(b.text for b in system if b.text and not b.text.startswith(BILLING_HEADER))


def _append(message: Message, out: list[dict[str, Any]]) -> None:
    if message.role == "system":
        text = message.content if isinstance(message.content, str) else _text_of(message.content)
        if text and not text.startswith(BILLING_HEADER):
            out.append({"role": "system", "content": text})
        return
    if isinstance(message.content, str):
        out.append({"role": message.role, "content": message.content})
        return
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in message.content:
        if isinstance(block, TextBlock):
            if block.text:
                parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.source)}})
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input)  # as vLLM spells them: the same prompt
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": arguments},
                }
            )
        elif isinstance(block, ToolResultBlock):
            if message.role != "user":
                raise ApiError(
                    400,
                    "`tool_result` blocks belong in a user message.",
                    param="messages",
                    code="invalid_request_error",
                )
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": block.tool_use_id,
                    "content": _tool_result_text(block),
                }
            )
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        else:
            assert isinstance(block, RedactedThinkingBlock)  # opaque: nothing to hand on
    msg: dict[str, Any] = {"role": message.role}
    if reasoning:
        msg["reasoning"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    if parts:
        only_text = len(parts) == 1 and parts[0]["type"] == "text"
        msg["content"] = parts[0]["text"] if only_text else parts
    if "content" in msg or calls or reasoning:
        out.append(msg)


def _text_of(blocks: list[Any]) -> str:
    return "".join(b.text for b in blocks if isinstance(b, TextBlock))


def _tool_result_text(block: ToolResultBlock) -> str:
    if block.content is None:
        return ""
    if isinstance(block.content, str):
        return block.content
    return "\n".join(b.text for b in block.content if isinstance(b, TextBlock))


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    media_type = source.get("media_type", "image/jpeg")
    return f"data:{media_type};base64,{source.get('data', '')}"


def chat_tools(req: TokenCountRequest) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of the chat request."""
    out: dict[str, Any] = {}
    if req.tools is not None:
        out["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    **({"description": tool.description} if tool.description else {}),
                    "parameters": tool.input_schema,
                },
            }
            for tool in req.tools
        ]
    choice = req.tool_choice
    if choice is None:
        return out
    if choice.disable_parallel_tool_use is not None:
        out["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if not choice.name:
            raise ApiError(
                400,
                "tool_choice.name: Field required when tool_choice.type is `tool`.",
                param="tool_choice.name",
                code="invalid_request_error",
            )
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return out


def chat_request(req: MessagesRequest) -> dict[str, Any]:
    """The chat completion request a Messages request means (``model`` as the client named
    it: the core resolves it)."""
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req),
        "max_tokens": req.max_tokens,
    }
    for name, value in (
        ("temperature", req.temperature),
        ("top_p", req.top_p),
        ("top_k", req.top_k),
        ("stop", req.stop_sequences),
    ):
        if value is not None:
            body[name] = value
    if req.metadata is not None and req.metadata.user_id:
        body["user"] = req.metadata.user_id
    body.update(chat_tools(req))
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def tokenize_request(req: TokenCountRequest) -> dict[str, Any]:
    """The ``/tokenize`` body (``model`` aside) that renders the prompt a Messages request
    would send."""
    tools = chat_tools(req).get("tools")
    body: dict[str, Any] = {"messages": chat_messages(req)}
    if tools:
        body["tools"] = tools
    return body


# -- OpenAI → Anthropic ------------------------------------------------------------------


def message_id(chat_id: Any) -> str:
    """An Anthropic message id (``msg_…``) for a chat completion's id."""
    text = str(chat_id or "")
    return "msg_" + text.removeprefix("chatcmpl-")


def usage(openai: Any) -> dict[str, int]:
    """Anthropic's usage of an OpenAI usage object: ``input_tokens`` are the prompt's
    tokens vLLM computed, ``cache_read_input_tokens`` those its prefix cache held."""
    doc = openai if isinstance(openai, dict) else {}
    prompt = int(doc.get("prompt_tokens") or 0)
    out = {"input_tokens": prompt, "output_tokens": int(doc.get("completion_tokens") or 0)}
    details = doc.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, int) and cached > 0:
        out["input_tokens"] = max(prompt - cached, 0)
        out["cache_read_input_tokens"] = cached
    return out


def stop_reason(finish: Any, matched: Any, tool_used: bool) -> tuple[str | None, str | None]:
    """``(stop_reason, stop_sequence)`` of an OpenAI finish reason and vLLM's ``stop_reason``
    (the stop string matched, if one was)."""
    if finish == "length":
        return "max_tokens", None
    if finish not in ("stop", "tool_calls"):
        return ("end_turn", None) if finish is None else (None, None)
    if tool_used or finish == "tool_calls":
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def tool_input(arguments: Any) -> Any:
    """A tool call's arguments (JSON text) as the ``input`` object."""
    if not isinstance(arguments, str):
        return arguments if isinstance(arguments, dict) else {}
    try:
        parsed = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def message_body(chat: bytes) -> bytes:
    """A chat completion (JSON bytes) as a Messages answer (JSON bytes)."""
    doc = orjson.loads(chat)
    choice = (doc.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    calls = message.get("tool_calls") or []
    for call in calls:
        fn = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id") or "",
                "name": fn.get("name") or "",
                "input": tool_input(fn.get("arguments")),
            }
        )
    if not content:
        content.append({"type": "text", "text": ""})
    reason, sequence = stop_reason(
        choice.get("finish_reason"), choice.get("stop_reason"), bool(calls)
    )
    return orjson.dumps(
        {
            "id": message_id(doc.get("id")),
            "type": "message",
            "role": "assistant",
            "model": doc.get("model") or "",
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(doc.get("usage")),
        }
    )
