"""Fixtures of the exact-cache tests: real redis-server processes started by scripts/redis.sh."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.ports import free_port
from harness.redis_cluster import RedisClusterProcess

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "redis.sh"


@dataclass
class RedisServer:
    """A redis-server on loopback, started and stopped through ``scripts/redis.sh``."""

    port: int
    directory: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        subprocess.run(
            [str(SCRIPT), "start", str(self.port), str(self.directory)],
            check=True,
            capture_output=True,
            timeout=60,
        )
        return self

    def stop(self) -> None:
        subprocess.run(
            [str(SCRIPT), "stop", str(self.port), str(self.directory)],
            check=True,
            capture_output=True,
            timeout=30,
        )

    def running(self) -> bool:
        ping = subprocess.run([str(SCRIPT), "ping", str(self.port)], capture_output=True)
        return ping.returncode == 0


@pytest.fixture(scope="session")
def redis_installed() -> None:
    """Install redis-server from Debian when it is missing (the script does it quietly)."""
    if shutil.which("redis-server") or shutil.which("valkey-server"):
        return
    done = subprocess.run([str(SCRIPT), "install"], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"cannot install redis-server: {done.stderr.strip()}")


@pytest.fixture(scope="session")
def redis_server(
    redis_installed: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisServer]:
    """One real redis-server for the session, on a free loopback port."""
    server = RedisServer(free_port(), tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_factory(redis_installed: None, tmp_path: Path) -> Iterator[Callable[[], RedisServer]]:
    """Start private redis-servers (for tests that kill them); all are stopped at the end."""
    started: list[RedisServer] = []

    def make() -> RedisServer:
        d = tmp_path / f"redis{len(started)}"
        d.mkdir()
        server = RedisServer(free_port(), d).start()
        started.append(server)
        return server

    try:
        yield make
    finally:
        for s in started:
            s.stop()


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix of its own per test, so tests sharing the session server never collide."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def redis_cluster(
    redis_installed: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisClusterProcess]:
    """One real Redis Cluster (3 primaries + 3 replicas) for the session, on loopback."""
    cluster = RedisClusterProcess(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(params=["single", pytest.param("cluster", marks=pytest.mark.slow)])
def shared_redis_url(request: pytest.FixtureRequest) -> str:
    """The URL of the session's single redis-server, then of the session's Redis Cluster."""
    name = "redis_cluster" if request.param == "cluster" else "redis_server"
    return str(request.getfixturevalue(name).url)
