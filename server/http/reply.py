"""What a serving object hands its route: a complete body or a byte stream, and how a reply's
stream is closed when the response ends."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final

SSE_HEADERS: Final = {"cache-control": "no-store", "x-accel-buffering": "no"}
"""The headers of every event-stream response (no caching or buffering by proxies)."""


@dataclass
class Reply:
    """What a route sends back: a complete body or a byte stream."""

    status: int
    body: bytes = b""
    stream: AsyncIterable[bytes] | None = None
    media_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


class ClosingStream:
    """A response stream whose ``aclose`` closes the generator, then runs ``on_close``: for
    what must be released even when the generator never started (closing an unstarted
    generator runs none of its code)."""

    def __init__(
        self, stream: AsyncGenerator[bytes, None], on_close: Callable[[], Awaitable[None]]
    ) -> None:
        self._stream = stream
        self._on_close = on_close

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._stream

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            await self._on_close()


async def aclose_stream(stream: AsyncIterable[bytes]) -> None:
    """Close a response stream (a generator or a :class:`ClosingStream`), if it can be."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
