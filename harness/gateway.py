"""The real gateway on a free port for tests and benchmarks: in a thread, or as a child process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import msgspec
import tomli_w
import uvicorn
from opentelemetry.sdk.trace.export import SpanExporter

from backends.registry import ModelRegistry
from harness.ports import free_port
from harness.vllm_process import REPO_ROOT, test_data_dir
from server.app import create_app
from server.config import ENCODER_DIR_ENV, GatewayConfig
from server.http.uvicorn_config import uvicorn_config


def write_config_toml(config: GatewayConfig, path: Path) -> Path:
    """``config`` as the TOML file ``semcache serve --config`` reads: a test that builds its
    config as objects starts the real process (:class:`GatewayProcess`) on the same one.

    TOML has no null: a field left ``None`` is left out, which loads as the same default.
    """

    def present(value: object) -> object:
        if isinstance(value, dict):
            return {k: present(v) for k, v in value.items() if v is not None}
        if isinstance(value, list):
            return [present(v) for v in value]
        return value

    data = present(msgspec.to_builtins(config))
    assert isinstance(data, dict)
    path.write_text(tomli_w.dumps(data))
    return path


class GatewayThread:
    """The gateway as clients see it: a real HTTP server on 127.0.0.1."""

    def __init__(
        self,
        config: GatewayConfig,
        registry: ModelRegistry | None = None,
        *,
        span_exporter: SpanExporter | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``span_exporter``: tracing on, every span handed to it; ``clock``: the app's
        calendar clock (both ``create_app``)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(config, registry, span_exporter=span_exporter, clock=clock)
        self._server = uvicorn.Server(uvicorn_config(self.app, "127.0.0.1", self.port))
        # A daemon: a gateway that never stops fails its test (``stop``), not the whole run.
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._server.serve()), daemon=True
        )

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
        if self._thread.is_alive():
            raise RuntimeError(f"the gateway on {self.url} did not stop within 30 s")


class GatewayProcess:
    """``python -m server.cli serve --no-launch`` as a child process that the caller can kill;
    with ``launch=True``, ``semcache serve`` starting the vLLM servers its config launches."""

    def __init__(
        self,
        config: Path,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        *,
        launch: bool = False,
    ) -> None:
        """``env``: added to the child's environment (e.g. ``OTEL_*``).

        The gateways share one folder of exported encoder graphs (``SEMCACHE_ENCODER_DIR``,
        under the test data dir), as gateways on one host can: each graph is exported once
        per run, not once per gateway. A config's ``encoder_dir`` or ``env`` may name another.
        """
        shared = {
            ENCODER_DIR_ENV: os.environ.get(ENCODER_DIR_ENV, str(test_data_dir() / "encoders"))
        }
        self.extra_env = {**shared, **dict(env or {})}
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = config
        self.launch = launch
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []

    def start(self, timeout_s: float = 180.0) -> GatewayProcess:
        cmd = [
            sys.executable,
            "-m",
            "server.cli",
            "serve",
            *(() if self.launch else ("--no-launch",)),
            "--config",
            str(self.config),
            "--port",
            str(self.port),
        ]
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **self.extra_env},
        )
        ready = threading.Event()

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                if "[semcache] ready" in line:
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(timeout_s):
            self.kill()
            raise AssertionError("gateway did not start:\n" + "".join(self.lines[-40:]))
        return self

    def kill(self) -> None:
        """``kill -9``: no shutdown code runs, leases are not given back."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
