"""One more vLLM server for a pool, or one fewer: what ``semcache backends scale`` runs here.

``+1`` starts a server with the pool's launch settings (those of the pool's first launched
server, else the defaults plus the pool's profile) on a free port of the same host, with a NIXL
side-channel port of its own, and waits until it is healthy. It runs detached from the command
(its own session, no parent-death signal) and is recorded in
``<data_dir>/scaled/<backend>-<role>.json``. ``-1`` takes the last record back and stops that
server's process group. Joining and leaving the gateways is the command's part (their admin
API, ``server.admin.pools``): this module never talks to a gateway.
"""

from __future__ import annotations

import asyncio
import errno
import random
import socket
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
import psutil

from backends.config import ServerRole, VllmBackendConfig, VllmLaunch, VllmServer
from backends.launch.process import Progress, VllmProcess
from backends.launch.process_group import stop_process_group
from backends.models import prepare_model


class Scaled(msgspec.Struct):
    """A server ``scale +1`` started: where it listens and its process (group leader)."""

    url: str
    pid: int
    started: float
    """The leader's start time (``psutil``): a recycled pid is not ours."""
    log: str


def pool_of(backends: list[VllmBackendConfig], name: str) -> tuple[VllmBackendConfig, ServerRole]:
    """``BACKEND/ROLE``, or ``ROLE`` alone when there is one vLLM backend."""
    backend_name, _, role = name.rpartition("/")
    if role not in ("both", "prefill", "decode"):
        raise ValueError(f"pool {name!r}: the role is both, prefill or decode")
    if not backend_name:
        if len(backends) != 1:
            raise ValueError(f"pool {name!r}: name it BACKEND/{role} (several vLLM backends)")
        backend_name = backends[0].name
    for backend in backends:
        if backend.name == backend_name:
            return backend, role  # type: ignore[return-value]
    raise ValueError(f"no vLLM backend {backend_name!r} in the config")


PORTS = range(20000, 32768)
"""Where new servers listen: below Linux's ephemeral range (32768-60999), which the kernel
hands to every ``bind(port 0)`` and outgoing connection, so that a port found free is not
taken by one of those before vLLM binds it."""


def _free_port(host: str) -> int:
    for port in random.sample(PORTS, 200):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    continue
                raise ValueError(
                    f"cannot listen on {host} here ({exc}): scale runs on its host"
                ) from None
            return port
    raise ValueError(f"no free port on {host} in {PORTS.start}-{PORTS.stop - 1}")


def pool_launch(backend: VllmBackendConfig, role: ServerRole) -> VllmLaunch:
    """The pool's launch settings: those of its first launched server (the pool's profile
    already applied), else the defaults plus the pool's profile."""
    template = next((s for s in backend.servers if s.role == role and s.launch), None)
    if template is not None and template.launch is not None:
        return template.launch
    blank = VllmServer(url="http://127.0.0.1:8000", role=role, launch=VllmLaunch())
    return backend.launch_with_profile(blank)


def new_server(backend: VllmBackendConfig, role: ServerRole) -> VllmServer:
    """The next server of the pool: its launch settings on free ports of the same host."""
    template = next((s for s in backend.servers if s.role == role and s.launch), None)
    host = urlsplit(template.url).hostname if template else None
    host = host or "127.0.0.1"
    url = f"http://{host}:{_free_port(host)}"
    launch = pool_launch(backend, role)
    if role != "both":  # two servers on one host cannot share NIXL's side channel
        launch = msgspec.structs.replace(launch, nixl_side_channel_port=_free_port(host))
    return VllmServer(url=url, role=role, launch=launch, max_inflight=None)


class ScaleRecords:
    """The servers ``scale +1`` started for one pool, oldest first, in a JSON file."""

    def __init__(self, data_dir: Path, backend: str, role: str) -> None:
        self.path = data_dir / "scaled" / f"{backend}-{role}.json"

    def read(self) -> list[Scaled]:
        if not self.path.is_file():
            return []
        return msgspec.json.decode(self.path.read_bytes(), type=list[Scaled])

    def write(self, records: list[Scaled]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(records))
        tmp.replace(self.path)

    def add(self, record: Scaled) -> None:
        self.write([*self.read(), record])

    def remove(self, url: str) -> None:
        self.write([r for r in self.read() if r.url != url])


async def start_server(
    backend: VllmBackendConfig,
    role: ServerRole,
    data_dir: Path,
    *,
    ready_timeout_s: float,
    progress: Progress,
    traces_endpoint: str | None = None,
) -> tuple[VllmServer, Scaled]:
    """Start one more server of the pool, record it, and wait until it is healthy."""
    if backend.model_path is None:
        raise ValueError(f"backend {backend.name!r} launches vLLM but has no model_path")
    model = await asyncio.to_thread(prepare_model, backend.model_path, data_dir, progress)
    server = new_server(backend, role)
    process = VllmProcess(
        model=model,
        served_model=backend.served_model,
        server=server,
        data_dir=data_dir,
        log_name=backend.name,
        die_with_parent=False,
        traces_endpoint=traces_endpoint,
    )
    progress(f"starting vLLM {backend.name} ({role}) at {server.url}")
    process.start()
    assert process.pid is not None
    record = Scaled(
        server.url, process.pid, psutil.Process(process.pid).create_time(), str(process.log_path)
    )
    records = ScaleRecords(data_dir, backend.name, role)
    records.add(record)
    try:
        await process.wait_ready(ready_timeout_s, progress)
    except BaseException:
        await process.stop()
        records.remove(server.url)
        raise
    return server, record


async def stop_server(record: Scaled, grace_s: float = 20.0) -> None:
    """Stop a server ``start_server`` started (maybe in another process); gone is fine."""
    try:
        ours = psutil.Process(record.pid).create_time() == record.started
    except psutil.NoSuchProcess:
        ours = False
    if ours:
        await stop_process_group(record.pid, grace_s)
