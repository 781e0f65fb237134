"""``HEAD`` answered as ``GET`` is, without the body (RFC 9110 §9.3.2).

Litestar routes a ``HEAD`` only to handlers declared for it (a ``GET`` handler's would
answer 405), and its ``HEAD`` handlers may not return a body, so a ``Content-Length`` could
not be told. This layer, put before routing, hands the router the request as a ``GET`` (in a
copy of the scope: the server still knows it is a ``HEAD`` and sends no body either) and
sends the answer's status and headers, ``Content-Length`` included, with an empty body. The
``GET`` runs in full (its work, its accounting); its body is dropped as it comes.
"""

from __future__ import annotations

from typing import cast

from litestar.types import ASGIApp, HTTPScope, Message, Receive, Scope, Send


def head_as_get(app: ASGIApp) -> ASGIApp:
    """``app``, answering every ``HEAD`` as its ``GET`` without the body."""

    async def layer(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or cast(HTTPScope, scope)["method"] != "HEAD":
            await app(scope, receive, send)
            return
        as_get = cast(HTTPScope, {**scope, "method": "GET"})

        async def headless(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return  # dropped: only the last (empty) body message goes out
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await app(as_get, receive, headless)

    return layer
