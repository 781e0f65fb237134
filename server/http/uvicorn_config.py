"""How the gateway runs under uvicorn (the CLI and the tests' real servers)."""

from __future__ import annotations

from typing import Any

import uvicorn

from server.http.internals import GatewayHttpProtocol


def uvicorn_config(app: Any, host: str, port: int) -> uvicorn.Config:
    """uvicorn's config for ``app`` on ``host:port``, with the gateway's HTTP protocol."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        lifespan="on",
        http=GatewayHttpProtocol,
        access_log=False,  # at level warning it logged nothing, but formatted its arguments
    )
