"""A real Redis Cluster on loopback for tests: three primaries, each with one replica.

Six ``redis-server --cluster-enabled yes`` processes (64 MB each, no persistence), joined by
``redis-cli --cluster create … --cluster-replicas 1 --cluster-yes``. :meth:`kill` sends
SIGKILL to one node, so tests can watch its replica take over; :meth:`pause` stops a node
(SIGSTOP) and :meth:`resume` lets it run on, so a replica can fall behind its primary.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness.ports import ephemeral_start, free_port

NODES = 6
BUS_OFFSET = 10_000
"""A cluster node also listens on its port + 10000 (the cluster bus)."""


def cluster_port() -> int:
    """A free port whose bus port is free too and below the ephemeral range, where an
    outgoing connection could take it first (a node whose bus port is taken exits)."""
    for _ in range(200):
        port = free_port()
        bus = port + BUS_OFFSET
        if bus >= ephemeral_start():
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", bus))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def _binary(*names: str) -> str:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError(f"none of {names} is installed")


@dataclass
class RedisClusterProcess:
    """Six redis-server processes under ``directory``, joined into one cluster."""

    directory: Path
    ports: list[int] = field(default_factory=list)
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    paused: set[int] = field(default_factory=set)

    @property
    def url(self) -> str:
        """The ``redis+cluster://`` URL listing every node as a startup node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self, timeout_s: float = 60.0) -> RedisClusterProcess:
        server = _binary("redis-server", "valkey-server")
        self.ports = [cluster_port() for _ in range(NODES)]
        for port in self.ports:
            d = self.directory / str(port)
            d.mkdir(parents=True, exist_ok=True)
            args = [server, "--port", str(port), "--bind", "127.0.0.1"]
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf")]
            args += ["--cluster-node-timeout", "2000", "--save", "", "--appendonly", "no"]
            args += ["--maxmemory", "64mb", "--dir", str(d), "--daemonize", "no"]
            log = (d / "redis.log").open("wb")
            self.procs[port] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        for port in self.ports:
            self._wait(functools.partial(self._pings, port), deadline, f"node {port}")
        create = [_binary("redis-cli", "valkey-cli"), "--cluster", "create"]
        create += [f"127.0.0.1:{p}" for p in self.ports]
        create += ["--cluster-replicas", "1", "--cluster-yes"]
        subprocess.run(create, check=True, capture_output=True, timeout=timeout_s)
        self.wait_ok(deadline)
        self._wait(self._replicas_online, deadline, "replica online on every primary")
        return self

    def cli(self, port: int, *args: str) -> str:
        """One redis-cli command against the node on ``port``; its output, stripped."""
        done = subprocess.run(
            [_binary("redis-cli", "valkey-cli"), "-p", str(port), *args],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return done.stdout.strip()

    def _pings(self, port: int) -> bool:
        return self.cli(port, "ping") == "PONG"

    def wait_ok(self, deadline: float) -> None:
        """Until every live node reports ``cluster_state:ok`` and all 16384 slots served."""

        def ok() -> bool:
            for port in self.live_ports():
                info = self.cli(port, "cluster", "info")
                if "cluster_state:ok" not in info or "cluster_slots_ok:16384" not in info:
                    return False
            return True

        self._wait(ok, deadline, "cluster_state:ok")

    def _replicas_online(self) -> bool:
        """Every primary's replica has finished its first sync: until then a ``WAIT`` for one
        replica (``[batch.queue] replicas``) times out on a cluster that is already ok."""
        for port in self.primaries():
            info = self.cli(port, "info", "replication")
            if "connected_slaves:0" in info or "state=online" not in info:
                return False
        return True

    def live_ports(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def primaries(self) -> list[int]:
        """Ports of the live nodes that are primaries now."""
        return [p for p in self.live_ports() if "role:master" in self.cli(p, "info", "replication")]

    def owner(self, key: str) -> int:
        """The port of the live primary whose slots hold ``key``'s (``CLUSTER NODES``)."""
        port = self.primaries()[0]
        slot = int(self.cli(port, "cluster", "keyslot", key))
        for line in self.cli(port, "cluster", "nodes").splitlines():
            # id, ip:port@bus, flags, primary, ping, pong, epoch, link, slots…
            fields = line.split()
            address, flags, ranges = fields[1], fields[2], fields[8:]
            if "master" not in flags or "fail" in flags:
                continue
            for part in ranges:
                low, _, high = part.partition("-")
                if low.isdigit() and int(low) <= slot <= int(high or low):
                    return int(address.split("@")[0].rsplit(":", 1)[1])
        raise LookupError(f"no live primary serves slot {slot}")

    def replica_of(self, port: int) -> int:
        """The port of the replica of the primary on ``port`` (``INFO replication``)."""
        for line in self.cli(port, "info", "replication").splitlines():
            if line.startswith("slave0:"):
                fields = dict(kv.split("=", 1) for kv in line.split(":", 1)[1].split(","))
                return int(fields["port"])
        raise LookupError(f"the primary on {port} has no replica")

    def pause(self, port: int) -> None:
        """SIGSTOP the node on ``port``: it reads nothing until :meth:`resume`."""
        os.kill(self.procs[port].pid, signal.SIGSTOP)
        self.paused.add(port)

    def resume(self, port: int) -> None:
        """SIGCONT a node :meth:`pause` stopped."""
        os.kill(self.procs[port].pid, signal.SIGCONT)
        self.paused.discard(port)

    def kill(self, port: int) -> None:
        """SIGKILL the node on ``port`` (no shutdown, no save)."""
        proc = self.procs[port]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        self.paused.discard(port)

    def stop(self) -> None:
        for port in list(self.paused):
            self.resume(port)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    @staticmethod
    def _wait(check: Callable[[], bool], deadline: float, what: str) -> None:
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis cluster: no {what} in time")
            time.sleep(0.1)
