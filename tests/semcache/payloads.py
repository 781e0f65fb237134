"""Hand-written answers in the exact shapes vLLM's OpenAI server sends (chat, completions,
embeddings; JSON and SSE chunks), for the replay and cache tests."""

from __future__ import annotations

from typing import Any

import orjson

MODEL = "qwen3-0.6b"
CREATED = 1_718_000_000


def _j(doc: dict[str, Any]) -> bytes:
    return orjson.dumps(doc)


def chat_json(
    content: str = "Paris is the capital of France.",
    *,
    prompt_tokens: int = 14,
    completion_tokens: int = 8,
    cid: str = "chatcmpl-8f1c2b",
) -> bytes:
    return _j(
        {
            "id": cid,
            "object": "chat.completion",
            "created": CREATED,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": content,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "tool_calls": [],
                        "reasoning_content": None,
                    },
                    "logprobs": None,
                    "finish_reason": "stop",
                    "stop_reason": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens,
                "prompt_tokens_details": None,
            },
            "prompt_logprobs": None,
            "kv_transfer_params": None,
        }
    )


def _chat_chunk(cid: str, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = None
    choice.update(extra)
    return _j(
        {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": MODEL,
            "choices": [choice],
        }
    )


def chat_stream(
    pieces: tuple[str, ...] = ("Paris", " is the capital", " of France."),
    *,
    usage: bool = True,
    cid: str = "chatcmpl-5d0e9a",
) -> list[bytes]:
    """Chunk payloads of a streamed chat answer (with the usage chunk when ``usage``)."""
    out = [_chat_chunk(cid, {"role": "assistant", "content": ""})]
    out += [_chat_chunk(cid, {"content": p}) for p in pieces]
    out.append(_chat_chunk(cid, {}, "stop"))
    if usage:
        out.append(
            _j(
                {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": CREATED,
                    "model": MODEL,
                    "choices": [],
                    "usage": {"prompt_tokens": 14, "total_tokens": 22, "completion_tokens": 8},
                }
            )
        )
    return out


def tool_call_stream(cid: str = "chatcmpl-77aa01") -> list[bytes]:
    """A streamed tool call as vLLM's hermes parser emits it: name first, then argument pieces."""
    return [
        _chat_chunk(cid, {"role": "assistant", "content": ""}),
        _chat_chunk(
            cid,
            {
                "tool_calls": [
                    {
                        "id": "chatcmpl-tool-3c9f",
                        "type": "function",
                        "index": 0,
                        "function": {"name": "get_weather"},
                    }
                ]
            },
        ),
        _chat_chunk(cid, {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        _chat_chunk(cid, {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        _chat_chunk(cid, {}, "tool_calls"),
        _j(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": CREATED,
                "model": MODEL,
                "choices": [],
                "usage": {"prompt_tokens": 120, "total_tokens": 138, "completion_tokens": 18},
            }
        ),
    ]


def tool_call_json(cid: str = "chatcmpl-77aa02") -> bytes:
    return _j(
        {
            "id": cid,
            "object": "chat.completion",
            "created": CREATED,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": None,
                        "reasoning_content": None,
                        "tool_calls": [
                            {
                                "id": "chatcmpl-tool-1b2c",
                                "type": "function",
                                "function": {
                                    "name": "get_weather",
                                    "arguments": '{"city": "Paris"}',
                                },
                            }
                        ],
                    },
                    "logprobs": None,
                    "finish_reason": "tool_calls",
                    "stop_reason": None,
                }
            ],
            "usage": {"prompt_tokens": 120, "total_tokens": 138, "completion_tokens": 18},
        }
    )


def completion_stream(cid: str = "cmpl-3a7d", *, usage: bool = True) -> list[bytes]:
    def chunk(text: str, finish: str | None) -> bytes:
        return _j(
            {
                "id": cid,
                "object": "text_completion",
                "created": CREATED,
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": finish,
                        "stop_reason": None,
                    }
                ],
                "usage": None,
            }
        )

    out = [
        chunk(" Paris", None),
        chunk(",", None),
        chunk(" the city of light", None),
        chunk("", "length"),
    ]
    if usage:
        out.append(
            _j(
                {
                    "id": cid,
                    "object": "text_completion",
                    "created": CREATED,
                    "model": MODEL,
                    "choices": [],
                    "usage": {"prompt_tokens": 6, "total_tokens": 11, "completion_tokens": 5},
                }
            )
        )
    return out


def completion_json(cid: str = "cmpl-9e01") -> bytes:
    return _j(
        {
            "id": cid,
            "object": "text_completion",
            "created": CREATED,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "text": " Paris, the city of light",
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                    "prompt_logprobs": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {"prompt_tokens": 6, "total_tokens": 11, "completion_tokens": 5},
        }
    )


def embeddings_json() -> bytes:
    return _j(
        {
            "id": "embd-1f2e",
            "object": "list",
            "created": CREATED,
            "model": "all-MiniLM-L6-v2",
            "data": [{"index": 0, "object": "embedding", "embedding": [0.0123, -0.0456, 0.0789]}],
            "usage": {"prompt_tokens": 4, "total_tokens": 4, "completion_tokens": 0},
        }
    )


def responses_json(
    text: str = "Paris.", *, rid: str = "resp_8d7d43", status: str = "completed"
) -> bytes:
    """A Responses API answer (``object: response``), in vLLM's field order."""
    return _j(
        {
            "id": rid,
            "created_at": CREATED,
            "model": MODEL,
            "object": "response",
            "output": [
                {
                    "id": "msg_83a982",
                    "content": [{"annotations": [], "text": text, "type": "output_text"}],
                    "role": "assistant",
                    "status": "completed",
                    "type": "message",
                }
            ],
            "status": status,
            "usage": {"input_tokens": 25, "output_tokens": 2, "total_tokens": 27},
        }
    )


def _named(name: str, doc: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _j({**doc, "type": name}) + b"\n\n"


def responses_stream(rid: str = "resp_98bd1c") -> list[bytes]:
    """A streamed Responses API answer as vLLM frames it: named events, no ``[DONE]``."""
    item = {"id": "msg_9fbb52", "content": [], "role": "assistant", "type": "message"}
    created = {**orjson.loads(responses_json(rid=rid)), "output": [], "status": "in_progress"}
    del created["usage"]
    return [
        _named("response.created", {"response": created, "sequence_number": 0}),
        _named("response.output_item.added", {"item": item, "sequence_number": 1}),
        _named("response.output_text.delta", {"delta": "Par", "sequence_number": 2}),
        _named("response.output_text.delta", {"delta": "is.", "sequence_number": 3}),
        _named("response.output_text.done", {"text": "Paris.", "sequence_number": 4}),
        _named(
            "response.completed",
            {"response": orjson.loads(responses_json(rid=rid)), "sequence_number": 5},
        ),
    ]
