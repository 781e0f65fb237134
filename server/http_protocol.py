"""uvicorn's HTTP/1.1 protocol (httptools), sending a response's head with its first body bytes.

uvicorn writes each ASGI message to the socket as it comes: a JSON answer goes out as two
writes, the status line and headers, then the body. On loopback each write is a send system
call that also runs the receiver's TCP path (about 15 µs of CPU in the gateway per write) and
wakes the client twice. Here the first write of each response waits until the next write
of the same response, or at most until the end of the event loop's turn, and both go out in
one send: a JSON answer becomes one write, and nothing is held longer than the current turn
(a streamed answer's head goes out before its first chunk is awaited).
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HeadWithBody:
    """The transport as one response cycle sees it: its first write waits for its second."""

    __slots__ = ("_held", "_loop", "_passing", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._passing = False

    def write(self, data: bytes) -> None:
        if self._passing:
            self._transport.write(data)
        elif self._held is None:
            self._held = data
            self._loop.call_soon(self.flush)  # never held past this turn of the loop
        else:
            self._passing = True
            held, self._held = self._held, None
            self._transport.write(held + data)

    def flush(self) -> None:
        self._passing = True
        if self._held is not None:
            held, self._held = self._held, None
            if not self._transport.is_closing():
                self._transport.write(held)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self.flush()
        self._transport.close()


class GatewayHttpProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` whose response cycles write through ``HeadWithBody``."""

    def on_headers_complete(self) -> None:
        previous = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle is not previous:
            # The cycle's ASGI task is created, not yet run: it writes through the wrapper.
            cycle.transport = HeadWithBody(self.transport, self.loop)  # type: ignore[assignment]


def uvicorn_config(app: Any, host: str, port: int) -> uvicorn.Config:
    """How the gateway runs under uvicorn (the CLI and the tests' real servers)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        lifespan="on",
        http=GatewayHttpProtocol,
        access_log=False,  # at level warning it logged nothing, but formatted its arguments
    )
