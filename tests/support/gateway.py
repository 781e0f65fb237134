"""Runs the real gateway (uvicorn + the app factory) on a free port in a background thread."""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn

from backends.registry import ModelRegistry
from server.app import create_app
from server.config import GatewayConfig
from tests.support.vllm import free_port


class GatewayThread:
    """The gateway as clients see it: a real HTTP server on 127.0.0.1."""

    def __init__(self, config: GatewayConfig, registry: ModelRegistry | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(config, registry)
        self._server = uvicorn.Server(
            uvicorn.Config(
                self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
            )
        )
        self._server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve()))

    def start(self, timeout_s: float = 240.0) -> GatewayThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
