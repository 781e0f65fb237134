"""Server-sent events as OpenAI streams use them: framing, ``[DONE]``, and reading a stream.

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

    def feed(self, chunk: bytes) -> list[bytes]:
        """Add bytes; returns the payloads of the events they completed."""
        buf = self._buf + chunk
        if b"\r\n" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        *events, self._buf = buf.split(b"\n\n")
        new: list[bytes] = []
        for block in events:
            data = [line[5:].lstrip(b" ") for line in block.split(b"\n") if line[:5] == b"data:"]
            if data:
                new.append(b"\n".join(data))
        self.payloads.extend(new)
        return new

    @property
    def done(self) -> bool:
        """True when the stream ended with OpenAI's ``data: [DONE]`` terminator."""
        return bool(self.payloads) and self.payloads[-1] == DONE

    def usage(self) -> dict[str, int] | None:
        """The usage object of the last chunk carrying one, if any."""
        for payload in reversed(self.payloads):
            if b'"usage"' in payload and payload != DONE:
                try:
                    usage = orjson.loads(payload).get("usage")
                except orjson.JSONDecodeError:
                    continue
                if isinstance(usage, dict):
                    return usage
        return None
