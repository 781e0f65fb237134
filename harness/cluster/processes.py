"""The cluster's long-running processes: each started in its host's namespace, tracked by a
pid file and logged to a file under ``run_dir``, so that separate invocations (``up`` now,
``down`` later) find what an earlier one started."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from harness.cluster.topology import ClusterError, address, namespace
from harness.vllm_process import REPO_ROOT

START_MARK = "\n=== started "
"""Written to a log before each start (logs are appended to)."""


@dataclass(frozen=True)
class Service:
    """One long-running process on one host."""

    host: str
    command: list[str]
    env: Mapping[str, str]
    ready_url: str | None
    """Polled until it answers 200 (None: the TCP port below accepting is enough)."""
    port: int


class Processes:
    """Start, watch and stop the services ``services()`` names, all kept under ``run_dir``."""

    def __init__(
        self,
        run_dir: Path,
        services: Callable[[], Mapping[str, Service]],
        ready_timeout_s: float = 300.0,
    ) -> None:
        self.run_dir = run_dir
        self.services = services
        self.ready_timeout_s = ready_timeout_s

    def log_path(self, name: str) -> Path:
        return self.run_dir / "logs" / f"{name}.log"

    def _pid_file(self, name: str) -> Path:
        return self.run_dir / "pids" / f"{name}.pid"

    def pid(self, name: str) -> int | None:
        """The pid of ``name``'s process while it runs (a recycled pid does not count)."""
        try:
            pid_text, started = self._pid_file(name).read_text().split()
            proc = psutil.Process(int(pid_text))
            if abs(proc.create_time() - float(started)) > 1.0:
                return None
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc.pid
        except (OSError, ValueError, psutil.Error):
            return None

    def running(self, name: str) -> bool:
        return self.pid(name) is not None

    def start(self, name: str, *, wait: bool = True) -> None:
        """Start ``name`` in its host's namespace unless it runs; then wait until it serves."""
        if not self.running(name):
            service = self.services()[name]
            self.spawn(name, service.host, service.command, service.env)
        if wait:
            self.wait_ready(name)

    def spawn(
        self, name: str, host: str, command: list[str], env: Mapping[str, str] | None = None
    ) -> None:
        """Run ``command`` in ``host``'s namespace, logged and tracked as ``name``."""
        with self.log_path(name).open("ab") as out:
            out.write(f"{START_MARK}{time.strftime('%F %T')} {command}\n".encode())
            out.flush()
            popen = subprocess.Popen(
                ["ip", "netns", "exec", namespace(host), *command],
                cwd=REPO_ROOT,
                env={**os.environ, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopped as one
            )
        started = psutil.Process(popen.pid).create_time()
        self._pid_file(name).write_text(f"{popen.pid} {started}\n")

    def wait_ready(self, name: str, timeout_s: float | None = None) -> float:
        """Seconds until ``name`` serves; ``ClusterError`` with its log tail if it exits first."""
        service = self.services()[name]
        began = time.monotonic()
        deadline = began + (timeout_s or self.ready_timeout_s)
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if not self.running(name):
                    raise ClusterError(f"{name} exited:\n{self.log_tail(name)}")
                if service.ready_url is None:
                    with socket.socket() as probe:
                        probe.settimeout(1.0)
                        if probe.connect_ex((address(service.host), service.port)) == 0:
                            return time.monotonic() - began
                else:
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(service.ready_url).status_code == 200:
                            return time.monotonic() - began
                time.sleep(0.25)
        raise ClusterError(f"{name} not ready after {timeout_s} s:\n{self.log_tail(name)}")

    def stop(self, name: str, sig: signal.Signals = signal.SIGTERM, grace_s: float = 15.0) -> None:
        """Signal ``name``'s process group, then SIGKILL what is left after ``grace_s``."""
        pid = self.pid(name)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, sig)
            deadline = time.monotonic() + grace_s
            while _group_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        self._pid_file(name).unlink(missing_ok=True)

    def kill(self, name: str) -> None:
        """``kill -9`` of the whole process group: no shutdown, connections just die."""
        self.stop(name, signal.SIGKILL, grace_s=5.0)

    def current_log(self, name: str) -> str:
        """What ``name``'s log holds since the process last started (logs are appended to)."""
        try:
            text = self.log_path(name).read_text(errors="replace")
        except OSError:
            return ""
        return text[text.rfind(START_MARK) :]

    def log_tail(self, name: str, chars: int = 3000) -> str:
        try:
            return self.log_path(name).read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _group_alive(pgid: int) -> bool:
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return True
    return False
