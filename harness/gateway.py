"""The real gateway on a free port for tests and benchmarks: in a thread, or as a child process.

``GatewayProcess`` is the one way tests and benches start ``semcache serve`` (the namespaced
cluster runs ``serve_command`` in its hosts); ``GatewayThread`` serves fast unit tests only.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

import httpx
import msgspec
import tomli_w

from backends.launch.process_group import die_with_parent_hook
from harness.ports import free_port
from harness.vllm_process import REPO_ROOT, test_data_dir

if TYPE_CHECKING:  # the app is imported where a thread serves it: starting a process, or
    # writing the cluster's commands, costs no import of the whole gateway
    from opentelemetry.sdk.trace.export import SpanExporter

    from backends.registry import ModelRegistry
    from server.config import GatewayConfig
    from server.surface import Surface


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
        surfaces: list[Surface] | None = None,
    ) -> None:
        """``span_exporter``: tracing on, every span handed to it; ``clock``: the app's
        calendar clock; ``surfaces``: the API surfaces served (all three ``create_app``)."""
        import uvicorn

        from server.app import create_app
        from server.http.uvicorn_config import uvicorn_config

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(
            config, registry, span_exporter=span_exporter, clock=clock, surfaces=surfaces
        )
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


READY = "[semcache] ready"
"""The line ``semcache serve`` prints once it serves."""

Cores = str | Iterable[int]
"""CPU cores as taskset takes them (``"0"``, ``"0,2"``, ``"2-3"``) or as numbers."""


def core_list(cores: Cores | None) -> str | None:
    """``cores`` as taskset's list (``None``: no pinning)."""
    if cores is None or isinstance(cores, str):
        return cores
    return ",".join(str(core) for core in sorted(cores))


def serve_command(
    config: Path,
    *,
    port: int | None = None,
    launch: bool = False,
    cores: Cores | None = None,
    args: Sequence[str] = (),
) -> list[str]:
    """``python -m server.cli serve --config CONFIG`` (``--no-launch`` unless ``launch``),
    on ``port`` (else the config's), pinned to ``cores`` with taskset (every thread it and
    the vLLM servers it launches start inherits them), with more ``args`` (``--policy``)."""
    command = [sys.executable, "-m", "server.cli", "serve", *(() if launch else ("--no-launch",))]
    command += ["--config", str(config), *(("--port", str(port)) if port else ()), *args]
    pinned = core_list(cores)
    return ["taskset", "-c", pinned, *command] if pinned else command


class GatewayProcess:
    """``semcache serve`` of a checkout as a child process that the caller can stop or kill.

    In a session of its own (a Ctrl-C at the terminal reaches only the caller, which stops
    it), and, when started from the main thread, given SIGTERM if the caller dies without
    stopping it. Its output goes to ``log`` (appended to), or to an unnamed file; ``lines``
    reads it back.
    """

    def __init__(
        self,
        config: Path,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        *,
        launch: bool = False,
        cores: Cores | None = None,
        args: Sequence[str] = (),
        checkout: Path = REPO_ROOT,
        log: Path | None = None,
    ) -> None:
        """``env``: added to the child's environment (e.g. ``OTEL_*``); ``launch``: ``semcache
        serve`` starts the vLLM servers its config launches; ``cores``: pinned there
        (``serve_command``); ``args``: more options of ``serve``; ``checkout``: the source
        tree that runs (another revision's, say).

        The gateways share one folder of exported encoder graphs (``SEMCACHE_ENCODER_DIR``,
        under the test data dir), as gateways on one host can: each graph is exported once
        per run, not once per gateway. A config's ``encoder_dir`` or ``env`` may name another.
        """
        from server.config import ENCODER_DIR_ENV

        shared = {
            ENCODER_DIR_ENV: os.environ.get(ENCODER_DIR_ENV, str(test_data_dir() / "encoders"))
        }
        self.extra_env = {**shared, **dict(env or {})}
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = config
        self.launch = launch
        self.cores = core_list(cores)
        self.args = tuple(args)
        self.checkout = checkout
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        """``time.monotonic()`` when the process was started."""
        self._out: IO[bytes] | None = None
        self._offset = 0

    @property
    def command(self) -> list[str]:
        return serve_command(
            self.config, port=self.port, launch=self.launch, cores=self.cores, args=self.args
        )

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def start(self, timeout_s: float = 180.0, *, wait: bool = True) -> GatewayProcess:
        """Start it; unless ``wait`` is false, wait until it serves (``wait``)."""
        out = self.log.open("ab+") if self.log else tempfile.TemporaryFile()
        self._out, self._offset = out, out.seek(0, os.SEEK_END)
        path = os.pathsep.join(filter(None, [str(self.checkout), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
        main = threading.current_thread() is threading.main_thread()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.command,
            cwd=self.checkout,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**env, **self.extra_env},
            start_new_session=True,
            # PR_SET_PDEATHSIG follows the thread that started the child, not the process
            preexec_fn=die_with_parent_hook(signal.SIGTERM) if main else None,
        )
        if wait:
            self.wait(timeout_s)
        return self

    def output(self) -> str:
        """What it has printed since it started."""
        if self._out is None:
            return ""
        fd = self._out.fileno()
        size = os.fstat(fd).st_size
        return os.pread(fd, max(0, size - self._offset), self._offset).decode(errors="replace")

    @property
    def lines(self) -> list[str]:
        """Its output's lines, each with its newline (a line still being written left out)."""
        lines = self.output().splitlines(keepends=True)
        if lines and not lines[-1].endswith("\n") and self.proc and self.proc.poll() is None:
            lines.pop()
        return lines

    def log_tail(self, lines: int = 40) -> str:
        return "".join(self.output().splitlines(keepends=True)[-lines:])

    def wait(self, timeout_s: float = 180.0) -> float:
        """Seconds from its start until it said it serves; ``AssertionError`` with its last
        lines when it exits first or takes longer than ``timeout_s`` (it is killed then)."""
        assert self.proc is not None, "not started"
        deadline = time.monotonic() + timeout_s
        while READY not in self.output():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"gateway exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError("gateway did not start:\n" + self.log_tail())
            time.sleep(0.01)
        return time.monotonic() - self.started_at

    def wait_answers(self, path: str = "/ready", timeout_s: float = 180.0) -> float:
        """Seconds from its start until ``GET path`` answers 200 (``/ready``: every backend has
        a healthy server); ``AssertionError`` as ``wait``'s."""
        assert self.proc is not None, "not started"
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.url + path).status_code == 200:
                        return time.monotonic() - self.started_at
                if self.proc.poll() is not None:
                    raise AssertionError(
                        f"gateway exited with {self.proc.returncode}:\n{self.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise AssertionError(f"{path} not 200 after {timeout_s} s:\n{self.log_tail()}")
                time.sleep(0.05)

    def kill(self) -> None:
        """``kill -9`` of its process group: no shutdown code runs, leases are not given back."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ctrl-C (SIGINT): it drains and stops what it launched; killed after ``timeout_s``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
