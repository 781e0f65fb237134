"""How a route's event stream is read, recorded and framed: OpenAI's bare ``data:`` chunks
ending in ``data: [DONE]`` (chat, completions), or the Responses API's named events ending
in a terminal event (``response.completed``, …)."""

from __future__ import annotations

from typing import Any, Final, Protocol

from foundation.sse import (
    DONE,
    DONE_EVENT,
    TERMINAL_EVENTS,
    SSEReader,
    block_event,
    event,
    parse_block,
)
from semcache import replay
from semcache.entry import CachedAnswer, ResponsesRecorder, StreamRecorder


class Recorder(Protocol):
    def feed(self, item: bytes) -> None: ...

    def answer(self) -> CachedAnswer | None: ...


class StreamFormat(Protocol):
    """One route's stream, as the cached relay reads, records and sends it."""

    @property
    def end(self) -> bytes:
        """What ends a replayed stream after its stored items."""
        ...

    def read(self, reader: SSEReader, chunk: bytes) -> list[bytes]:
        """The items (what is recorded and framed again) of the events ``chunk`` completed."""
        ...

    def recorder(self, model_id: str) -> Recorder: ...

    def is_last(self, item: bytes) -> bool:
        """The item ends the stream."""
        ...

    def frame(self, item: bytes) -> bytes: ...

    def live_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The body that asks the backend for a stream the cache can record."""
        ...

    def hidden(self, item: bytes, include_usage: bool) -> bool:
        """The item is recorded but not sent to a client that asked (or not) for usage."""
        ...


class DataChunks:
    """Chat and completions: the items are the ``data:`` payloads."""

    end: Final = DONE_EVENT

    def read(self, reader: SSEReader, chunk: bytes) -> list[bytes]:
        return reader.feed(chunk)

    def recorder(self, model_id: str) -> Recorder:
        return StreamRecorder(model_id)

    def is_last(self, item: bytes) -> bool:
        return item == DONE

    def frame(self, item: bytes) -> bytes:
        return event(item)

    def live_body(self, body: dict[str, Any]) -> dict[str, Any]:
        # The usage chunk is always asked for, so the stored answer knows its tokens.
        options = dict(body.get("stream_options") or {})
        return {**body, "stream_options": {**options, "include_usage": True}}

    def hidden(self, item: bytes, include_usage: bool) -> bool:
        return not include_usage and replay.is_usage_only(item)


class NamedEvents:
    """The Responses API: the items are whole event blocks, replayed byte for byte."""

    end: Final = b""

    def read(self, reader: SSEReader, chunk: bytes) -> list[bytes]:
        return reader.feed_events(chunk)

    def recorder(self, model_id: str) -> Recorder:
        return ResponsesRecorder(model_id)

    def is_last(self, item: bytes) -> bool:
        return parse_block(item)[0] in TERMINAL_EVENTS

    def frame(self, item: bytes) -> bytes:
        return block_event(item)

    def live_body(self, body: dict[str, Any]) -> dict[str, Any]:
        return body  # the terminal event carries the usage

    def hidden(self, item: bytes, include_usage: bool) -> bool:
        return False


def stream_format(route: str) -> StreamFormat:
    return NamedEvents() if route == "responses" else DataChunks()
