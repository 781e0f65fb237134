"""An OpenAI chat completion stream as Anthropic's Messages events.

``message_start``, ``ping``, then per content block ``content_block_start``,
``content_block_delta``… (``text_delta``, ``input_json_delta`` for a tool call's arguments,
``thinking_delta``), ``content_block_stop``; ``message_delta`` with the stop reason and the
usage (``input_tokens`` too: the prompt's count comes with the last chunk), ``message_stop``.
A live answer and a replayed one go through the same conversion, so a hit streams the same
events as the miss that stored it. A stream the backend broke or cut short ends with an
``error`` event and no ``message_stop``, so a client can tell it from a complete one.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable
from typing import Any, Final

import orjson

from foundation.sse import DONE, SSEReader
from server.anthropic.translate import message_id, stop_reason, usage

PING: Final = b'event: ping\ndata: {"type":"ping"}\n\n'


def named(name: str, doc: dict[str, Any]) -> bytes:
    """One Anthropic event: its name and its JSON data."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(doc) + b"\n\n"


def error_event(message: str, kind: str = "api_error") -> bytes:
    return named("error", {"type": "error", "error": {"type": kind, "message": message}})


class EventWriter:
    """The state of one converted stream: the open block, the tool calls seen, the end."""

    def __init__(self) -> None:
        self.started = False
        self.index = -1
        self.block: str | None = None
        self.tools: dict[int, int] = {}
        """An OpenAI tool call's index → its tool_use block's index."""
        self.tool_used = False
        self.finish: Any = None
        self.matched: Any = None
        self.usage: Any = None

    def chunk(self, doc: dict[str, Any]) -> list[bytes]:
        """The events of one OpenAI chunk."""
        out: list[bytes] = []
        if not self.started:
            self.started = True
            message: dict[str, Any] = {
                "id": message_id(doc.get("id")),
                "type": "message",
                "role": "assistant",
                "model": doc.get("model") or "",
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {**usage(doc.get("usage")), "output_tokens": 0},
            }
            out.append(named("message_start", {"type": "message_start", "message": message}))
            out.append(PING)
        if doc.get("usage"):
            self.usage = doc["usage"]
        for choice in doc.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue  # Anthropic answers one message
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
                self.matched = choice.get("stop_reason")
            delta = choice.get("delta") or {}
            thought = delta.get("reasoning_content") or delta.get("reasoning")
            if thought:
                self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""}, out)
                out.append(self._delta({"type": "thinking_delta", "thinking": thought}))
            if delta.get("content"):
                self._open("text", {"type": "text", "text": ""}, out)
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                self._tool_call(call, out)
        return out

    def _tool_call(self, call: dict[str, Any], out: list[bytes]) -> None:
        position = call.get("index", 0)
        fn = call.get("function") or {}
        if position not in self.tools:
            block = {"type": "tool_use", "id": call.get("id") or "", "name": fn.get("name") or ""}
            self._open("tool_use", {**block, "input": {}}, out, force=True)
            self.tools[position] = self.index
            self.tool_used = True
        arguments = fn.get("arguments")
        if arguments and self.tools[position] == self.index:
            out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))

    def _open(
        self, kind: str, block: dict[str, Any], out: list[bytes], *, force: bool = False
    ) -> None:
        if self.block == kind and not force:
            return
        self._close(out)
        self.index += 1
        self.block = kind
        out.append(
            named(
                "content_block_start",
                {"type": "content_block_start", "index": self.index, "content_block": block},
            )
        )

    def _close(self, out: list[bytes]) -> None:
        if self.block is not None:
            out.append(
                named("content_block_stop", {"type": "content_block_stop", "index": self.index})
            )
            self.block = None

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return named(
            "content_block_delta",
            {"type": "content_block_delta", "index": self.index, "delta": delta},
        )

    def end(self) -> list[bytes]:
        """The events after the last chunk: the open block closed, the stop reason and usage."""
        out: list[bytes] = []
        if self.index < 0:  # nothing was said: one empty text block, as the JSON answer has
            self._open("text", {"type": "text", "text": ""}, out)
        self._close(out)
        reason, sequence = stop_reason(self.finish, self.matched, self.tool_used)
        out.append(
            named(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage(self.usage),
                },
            )
        )
        out.append(named("message_stop", {"type": "message_stop"}))
        return out


async def message_events(source: AsyncIterable[bytes]) -> AsyncGenerator[bytes, None]:
    """OpenAI chat completion SSE bytes → Anthropic events (see the module doc); the events
    of one source chunk go out together."""
    reader = SSEReader()
    writer = EventWriter()
    async for chunk in source:
        out: list[bytes] = []
        for payload in reader.feed(chunk):
            if payload == DONE:
                yield b"".join([*out, *writer.end()])
                return
            try:
                doc = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(doc, dict):
                continue
            failure = doc.get("error")
            if isinstance(failure, dict):
                message = failure.get("message") or "The model failed mid-answer."
                yield b"".join([*out, error_event(str(message))])
                return
            out.extend(writer.chunk(doc))
        if out:
            yield out[0] if len(out) == 1 else b"".join(out)
    yield error_event("The model ended the answer early.")
