"""Server-sent events as OpenAI streams use them: framing, ``[DONE]``, and reading a stream.

Chat and completions streams are bare ``data:`` events ending in ``data: [DONE]``; the
Responses API names each event (``event: response.output_text.delta``) and ends with a
terminal event (``response.completed``, ``response.incomplete`` or ``response.failed``).

Imports nothing from the project, so every layer (the server's relays, the cache's recorder)
frames and parses events the same way.
"""

from __future__ import annotations

from typing import Final

import orjson

MEDIA_TYPE: Final = "text/event-stream"
DONE: Final = b"[DONE]"
"""The payload of OpenAI's last event (``data: [DONE]``)."""


def event(payload: bytes) -> bytes:
    """One event carrying ``payload`` as its data."""
    return b"data: " + payload + b"\n\n"


DONE_EVENT: Final = event(DONE)

TERMINAL_EVENTS: Final = frozenset(
    {b"response.completed", b"response.incomplete", b"response.failed"}
)
"""The events that end a Responses API stream (it sends no ``[DONE]``)."""


def parse_block(block: bytes) -> tuple[bytes | None, bytes | None]:
    """The name (``event:``) and the data of one event block, each ``None`` when absent."""
    name = None
    data = []
    for line in block.split(b"\n"):
        if line[:5] == b"data:":
            data.append(line[5:].lstrip(b" "))
        elif line[:6] == b"event:":
            name = line[6:].strip()
    return name, b"\n".join(data) if data else None


def error_event(message: str, *, type: str = "server_error", code: str | None = None) -> bytes:
    """An error in the stream, which the openai SDK raises as ``APIError``."""
    return event(
        orjson.dumps({"error": {"message": message, "type": type, "param": None, "code": code}})
    )


class SSEReader:
    """Collects the ``data:`` payloads of an event stream fed in arbitrary byte chunks."""

    def __init__(self) -> None:
        self._buf = b""
        self.payloads: list[bytes] = []
        self._terminal = False
        """The last event so far is a Responses API terminal event."""

    def _blocks(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk
        if b"\r\n" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        *blocks, self._buf = buf.split(b"\n\n")
        return blocks

    def feed(self, chunk: bytes) -> list[bytes]:
        """Add bytes; returns the payloads of the events they completed."""
        new: list[bytes] = []
        for block in self._blocks(chunk):
            if block[:6] == b"event:":  # a named event (the Responses API)
                name, payload = parse_block(block)
                if payload is not None:
                    self._terminal = name in TERMINAL_EVENTS
                    new.append(payload)
                continue
            data = [line[5:].lstrip(b" ") for line in block.split(b"\n") if line[:5] == b"data:"]
            if data:
                self._terminal = False
                new.append(b"\n".join(data))
        self.payloads.extend(new)
        return new

    def feed_events(self, chunk: bytes) -> list[bytes]:
        """Add bytes; returns the whole blocks (``event:`` and ``data:`` lines, without the
        blank line that ends each) of the data events they completed."""
        new: list[bytes] = []
        for block in self._blocks(chunk):
            name, payload = parse_block(block)
            if payload is not None:
                self._terminal = name in TERMINAL_EVENTS
                self.payloads.append(payload)
                new.append(block)
        return new

    @property
    def done(self) -> bool:
        """True when the stream ended with OpenAI's ``data: [DONE]`` terminator, or with a
        Responses API terminal event."""
        return bool(self.payloads) and (self._terminal or self.payloads[-1] == DONE)

    def usage(self) -> dict[str, int] | None:
        """The usage object of the last chunk carrying one, if any (a Responses API event
        carries it in its ``response``)."""
        for payload in reversed(self.payloads):
            if b'"usage"' in payload and payload != DONE:
                try:
                    doc = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    continue
                usage = doc.get("usage") if isinstance(doc, dict) else None
                if (
                    usage is None
                    and isinstance(doc, dict)
                    and isinstance(doc.get("response"), dict)
                ):
                    usage = doc["response"].get("usage")
                if isinstance(usage, dict):
                    return usage
        return None


def block_event(block: bytes) -> bytes:
    """A block read by :meth:`SSEReader.feed_events`, framed again as it arrived."""
    return block + b"\n\n"
