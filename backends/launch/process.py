"""One launched vLLM server's process: start it, wait until it is healthy, stop it.

The server runs in its own process group, so stopping it (or the gateway's Ctrl-C) takes
vLLM's engine children down with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import httpx
import psutil

from backends.config import VllmLaunch, VllmServer
from backends.launch import cpu_pinning
from backends.launch.command import Device, build_command, detect_device, host_port
from backends.launch.process_group import die_with_parent_hook, living, process_group_members

Progress = Callable[[str], None]


class VllmStartError(RuntimeError):
    """A vLLM server did not become healthy (it exited, or timed out); carries its log tail."""


class VllmProcess:
    """One vLLM OpenAI server started from a ``VllmServer`` entry (and its ``launch``)."""

    def __init__(
        self,
        *,
        model: Path,
        served_model: str,
        server: VllmServer,
        data_dir: Path,
        device: Device | None = None,
        python: str | None = None,
        log_name: str | None = None,
        kv_lease_s: int = 30,
        die_with_parent: bool = True,
        traces_endpoint: str | None = None,
        console: bool = False,
    ) -> None:
        """``die_with_parent=False``: the server outlives this process
        (``backends.launch.scale``); ``traces_endpoint``: where vLLM exports its spans;
        ``console``: vLLM writes to this process's stdout and stderr instead of a log file
        (a container's one server, whose output the container runtime collects)."""
        self.server = server
        self.die_with_parent = die_with_parent
        self.console = console
        self.url = server.url.rstrip("/")
        self.device: Device = device or detect_device()
        self.command, self.extra_env = build_command(
            model=model,
            served_model=served_model,
            server=server,
            device=self.device,
            python=python or sys.executable,
            kv_lease_s=kv_lease_s,
            traces_endpoint=traces_endpoint,
        )
        self.cores: frozenset[int] | None = None
        """The CPU cores every process of the server runs on (None: wherever it likes)."""
        cores = (server.launch or VllmLaunch()).cpu_cores if self.device == "cpu" else None
        if cores is not None and cores not in cpu_pinning.VLLM_WORDS:
            self.cores = cpu_pinning.parse_cores(cores)
            if missing := self.cores - set(range(os.cpu_count() or 1)):
                raise ValueError(f"vLLM at {server.url}: no CPU core {sorted(missing)} here")
        host, port = host_port(server.url)
        name = log_name or re.sub(r"[^A-Za-z0-9_.-]+", "_", served_model)
        self.log_path = data_dir / "logs" / f"vllm-{name}-{server.role}-{port}.log"
        self._host, self._port = host, port
        self._popen: subprocess.Popen[bytes] | None = None
        self._family: list[psutil.Process] = []
        self._gone = False

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen else None

    @property
    def returncode(self) -> int | None:
        return self._popen.poll() if self._popen else None

    def start(self) -> None:
        """Spawn the server and return at once (see ``wait_ready``).

        Call it from a long-lived thread such as the event loop's: the server is told to die
        with the thread that spawned it (Linux ``PR_SET_PDEATHSIG``), so a gateway killed
        outright does not leave vLLM behind.
        """
        if self._popen is not None:
            raise RuntimeError(f"vLLM at {self.url} was already started")
        with socket.socket() as probe:
            probe.settimeout(1.0)
            if probe.connect_ex((self._host, self._port)) == 0:
                # Otherwise /health could be answered by whatever already listens there.
                raise VllmStartError(f"cannot start vLLM at {self.url}: the port is in use")
        env = {**os.environ, **self.extra_env}
        if self.console:
            self._popen = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=self._child_setup(),
            )
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"\n=== {time.strftime('%F %T')} starting: {self.command}\n".encode())
            log.flush()
            # Own session = own process group: signals reach every vLLM child, and the
            # terminal's Ctrl-C goes to the gateway, which then stops us in order.
            self._popen = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=self._child_setup(),
            )

    def _child_setup(self) -> Callable[[], None] | None:
        """What the child runs before exec: its core pinning, its death with the gateway."""
        hooks = [die_with_parent_hook() if self.die_with_parent else None]
        hooks.append(cpu_pinning.pin_hook(self.cores) if self.cores is not None else None)
        chosen = [hook for hook in hooks if hook is not None]
        if not chosen:
            return None

        def setup() -> None:
            for hook in chosen:
                hook()

        return setup

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log."""
        if self.console:
            return "(its output is above)"
        try:
            with self.log_path.open("rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - 64 * 1024))
                text = log.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    async def wait_ready(self, timeout_s: float = 600.0, progress: Progress | None = None) -> float:
        """Poll ``/health`` until it answers 200; returns the seconds waited.

        Raises ``VllmStartError`` with the log tail as soon as the process exits, or on timeout.
        """
        if self._popen is None:
            raise RuntimeError("start() the server first")
        started = time.monotonic()
        next_note = started + 5.0
        async with httpx.AsyncClient(timeout=httpx.Timeout(2.0)) as client:
            while True:
                code = self._popen.poll()
                if code is not None:
                    raise VllmStartError(
                        f"vLLM at {self.url} exited with code {code} before it was ready "
                        f"(log {self.log_path}):\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/health")).status_code == 200:
                        self._remember_family()
                        return time.monotonic() - started
                now = time.monotonic()
                if now - started > timeout_s:
                    raise VllmStartError(
                        f"vLLM at {self.url} not ready after {timeout_s:.0f} s "
                        f"(log {self.log_path}):\n{self.log_tail()}"
                    )
                if progress is not None and now >= next_note:
                    progress(f"waiting for vLLM at {self.url} ({now - started:.0f}s)…")
                    next_note = now + 5.0
                await asyncio.sleep(0.5)

    def _remember_family(self) -> None:
        """Note the server's children while the parent still knows them: a child that moved to
        another process group would otherwise be missed when the group is signalled."""
        if self._popen is None or self._popen.poll() is not None:
            return
        with contextlib.suppress(psutil.Error):
            known = {p.pid for p in self._family}
            for child in psutil.Process(self._popen.pid).children(recursive=True):
                if child.pid not in known:
                    self._family.append(child)

    def _signal_all(self, sig: signal.Signals) -> None:
        if self._popen is None or not self._remaining():
            # Once the whole group is gone its number may be reused: never signal it again.
            return
        self._remember_family()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._popen.pid, sig)
        for proc in living(self._family):
            with contextlib.suppress(psutil.Error):
                proc.send_signal(sig)

    def _remaining(self) -> list[psutil.Process]:
        """Our processes still alive (zombies aside); empty once, empty for good."""
        if self._popen is None or self._gone:
            return []
        self._popen.poll()  # reap the leader so it does not linger as a zombie
        found = {p.pid: p for p in process_group_members(self._popen.pid)}
        found.update({p.pid: p for p in living(self._family)})
        if self._popen.returncode is not None and not found:
            self._gone = True
        return list(found.values())

    def terminate(self) -> None:
        """Ask the whole server (all its processes) to shut down; returns at once."""
        self._signal_all(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the server and all its processes now (simulates a crash in tests)."""
        if self._popen is not None and self._popen.poll() is None:
            # The group first, in one call (the leader is alive, so its number is ours): the
            # search for stragglers below walks /proc, which takes seconds when a busy thread
            # of this process holds the GIL, and a crash must not let the server run on.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._popen.pid, signal.SIGKILL)
        self._signal_all(signal.SIGKILL)
        if self._popen is not None:
            self._popen.wait()

    def pause(self) -> None:
        """SIGSTOP every process of the server: it accepts connections and answers nothing
        (a stalled server, in tests); ``resume`` lets it go on."""
        self._signal_all(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_all(signal.SIGCONT)

    async def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the process group, wait up to ``grace_s``, then SIGKILL what is left."""
        if self._popen is None:
            return
        try:
            self.terminate()
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                if not self._remaining():
                    break
                await asyncio.sleep(0.2)
        finally:  # also when cancelled mid-wait: never leave vLLM behind
            if self._remaining():
                self.kill()
            self._popen.wait()

    async def __aenter__(self) -> VllmProcess:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
