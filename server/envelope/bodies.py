"""Request and response bodies for the request log, only where a rule says ``log_bodies``."""

from __future__ import annotations

from typing import Any

from litestar.types import Receive, ReceiveMessage


class BodyCapture:
    """The bodies of one request, each kept up to ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.request = bytearray()
        self.response = bytearray()
        self.truncated = False
        self.wanted = False
        """Set when the answer starts, from the rule of the request's model and route."""

    def receiving(self, receive: Receive) -> Receive:
        """``receive``, keeping what the route reads of the request body."""

        async def kept() -> ReceiveMessage:
            message = await receive()
            if message["type"] == "http.request":
                self._keep(self.request, message.get("body", b""))
            return message

        return kept

    def sent(self, chunk: bytes) -> None:
        if self.wanted:
            self._keep(self.response, chunk)

    def _keep(self, into: bytearray, chunk: bytes) -> None:
        room = self.limit - len(into)
        if len(chunk) > room:
            self.truncated = True
        into += chunk[: max(room, 0)]

    def fields(self) -> dict[str, Any]:
        return {
            "request_body": self.request.decode("utf-8", "replace"),
            "response_body": self.response.decode("utf-8", "replace"),
            "bodies_truncated": self.truncated,
        }
