"""A multi-host deployment on one Linux machine, for tests, benchmarks and demos.

Each host is a network namespace (``sc-<host>``) with one interface, ``eth0``, plugged into
a bridge that lives in a namespace of its own (``sc-switch``); the machine itself joins the
bridge as the client (``10.77.0.1``, interface ``sc-client``), so tests and benchmarks reach
every host, and nothing is routed beyond the subnet (no host has a default route):

=======  ============  ==================================================================
host     address       runs
=======  ============  ==================================================================
lb       10.77.0.10    HAProxy on :8080, health-checking the gateways' ``/ready``
gw1      10.77.0.11    ``semcache serve --no-launch`` on :8080
gw2      10.77.0.12    the same, same config but for its address and data directory
redis    10.77.0.20    redis-server on :6379 (no persistence): the L3 tier, purge epochs,
                       the batch queue
c1-c3    10.77.0.21-23 with ``cache_cluster`` (``--cache-cluster``), instead of ``redis``:
                       Redis Cluster nodes on :6379, :6380 and :6381 each; three primaries
                       with two replicas each, every copy of a slot on another host
p1       10.77.0.31    vLLM prefill (NixlConnector producer) on :8000, pinned to core 0
d1       10.77.0.32    vLLM decode (NixlConnector consumer) on :8000, pinned to core 1
d2       10.77.0.33    a second decode server, a spare: not started by ``up``, not in the
                       gateways' config (a test starts it and adds it through the admin API)
=======  ============  ==================================================================

The KV cache moves from p1 to d1 through NIXL over UCX. With ``kv_transport="tcp"`` (the
default) UCX may use TCP on ``eth0`` only (``UCX_TLS=tcp``), so the KV crosses the veth
pair and the bridge like it would cross a network; ``"shm"`` leaves UCX free to pick
shared memory (the hosts still share one kernel), the baseline the bench compares with.
UCX logs the protocols it picked (``UCX_PROTO_INFO``) in the vLLM logs.

Everything runs from files under ``run_dir`` (configs, logs, a pid file per process), so
``up`` and ``down`` work from separate invocations (``scripts/cluster.sh``) and both are
idempotent: ``up`` starts what is not running, ``down`` stops whatever a pid file names and
deletes the namespaces. It needs root, ``ip`` with netns support, ``haproxy`` and
``redis-server`` (``missing_requirements`` says which are absent).

    python -m harness.cluster up|down|status [--run-dir DIR] [--kv-transport tcp|shm]
        [--cache-cluster]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx
import psutil

from backends.config import ServerRole, VllmServer
from backends.launch.command import build_command, detect_device
from harness import netem
from harness.tiny_llama import build_tiny_llama
from harness.vllm_process import (
    REPO_ROOT,
    TINY_MODEL_NAME,
    single_process_launch,
    test_data_dir,
)

KvTransport = Literal["tcp", "shm"]

SUBNET = "10.77.0"
CLIENT_ADDRESS = f"{SUBNET}.1"
PREFIX = "sc-"
SWITCH = f"{PREFIX}switch"
BRIDGE = "br0"
CLIENT_LINK = f"{PREFIX}client"
ADDRESSES = {
    "lb": 10,
    "gw1": 11,
    "gw2": 12,
    "redis": 20,
    "c1": 21,
    "c2": 22,
    "c3": 23,
    "p1": 31,
    "d1": 32,
    "d2": 33,
}
SPARES = ("d2",)
"""Services ``up`` leaves stopped unless named."""
CACHE_HOSTS = ("c1", "c2", "c3")
"""With ``cache_cluster``: the hosts of the replicated shared tier, a Redis Cluster of three
primaries with two replicas each, every copy of a slot on another host. Two, not one: a
shard whose primary is lost still has a replica behind the promoted one, so writes that wait
for a replica (``replicas = 1``) are acknowledged again once the failover is over, instead of
being refused until the lost node is back."""
CACHE_PORTS = (6379, 6380, 6381)
CACHE_REPLICAS = 2
CACHE_NODE_TIMEOUT_MS = 2000
"""How long a primary may stay silent before its replica is promoted (``cluster-node-timeout``)."""
GATEWAYS = ("gw1", "gw2")
GATEWAY_PORT = 8080
LB_PORT = 8080
LB_STATS_PORT = 8404
REDIS_PORT = 6379
VLLM_PORT = 8000
NIXL_PORT = 5600
TOKEN = "cluster-admin-token"
METERED_TOKEN = "cluster-metered-token"
"""A second tenant's token with a per-minute request limit, counted in the Redis host."""
METERED_RPM = 8
"""The bearer token of the gateways' one tenant (``cluster``, admin role)."""
MODEL_ID = "tiny-chat"
SEMANTIC_MODEL_ID = "tiny-semantic"
"""The same backend with the semantic cache on for chat (the policy's only semantic rule)."""
WORKERS_AI_MODEL = "@cf/test/tiny"
START_MARK = "\n=== started "
HOST_HEADER = "x-cluster-host"
"""Sent to the LB: pins the request to that gateway (while it is up). Answered by the LB:
the gateway that served the request."""

NO_GATEWAY_BODY = (
    '{"error":{"message":"No gateway is ready to answer.","type":"server_error",'
    '"param":null,"code":"backend_unavailable"}}'
)
"""What the LB answers (503, ``Retry-After``) when no gateway passes its health check."""


class ClusterError(RuntimeError):
    """The cluster could not be built or a host did not come up; carries a log tail."""


def _netem_name(host: str) -> str:
    return f"netem-{host}"


def address(host: str) -> str:
    return f"{SUBNET}.{ADDRESSES[host]}"


def namespace(host: str) -> str:
    return f"{PREFIX}{host}"


def host_of(ip: str) -> str:
    """The host at address ``ip``."""
    return next(h for h in ADDRESSES if address(h) == ip)


def cache_node(host: str, port: int) -> str:
    """The service name of the cache node on ``host``:``port``."""
    return f"{host}-{port}"


def missing_requirements() -> list[str]:
    """What this machine lacks to build a cluster (empty: it can)."""
    missing = []
    if not sys.platform.startswith("linux"):
        return ["Linux"]
    if os.geteuid() != 0:
        missing.append("root (network namespaces)")
    if shutil.which("ip") is None:
        missing.append("the `ip` command (iproute2)")
    elif subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        missing.append("`ip netns` (network namespace support)")
    if shutil.which("haproxy") is None:
        missing.append("haproxy (scripts/haproxy.sh install)")
    if shutil.which("redis-server") is None and shutil.which("valkey-server") is None:
        missing.append("redis-server (scripts/redis.sh install)")
    return missing


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise ClusterError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _namespaces() -> set[str]:
    out = _ip("netns", "list").stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def build_network() -> None:
    """The switch, one namespace per host and the client link (what exists is kept)."""
    existing = _namespaces()
    if SWITCH not in existing:
        _ip("netns", "add", SWITCH)
        _ip("-n", SWITCH, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", SWITCH, "link", "set", BRIDGE, "up")
    for host in ADDRESSES:
        ns, port = namespace(host), f"v-{host}"
        if ns not in existing:
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        if _ip("-n", ns, "link", "show", "eth0", check=False).returncode != 0:
            _ip("-n", SWITCH, "link", "del", port, check=False)
            _ip("link", "add", port, "netns", SWITCH, "type", "veth", "peer", "eth0", "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", SWITCH, "link", "set", port, "master", BRIDGE, "up")
    if _ip("link", "show", CLIENT_LINK, check=False).returncode != 0:
        _ip("link", "add", CLIENT_LINK, "type", "veth", "peer", "v-client", "netns", SWITCH)
        _ip("addr", "add", f"{CLIENT_ADDRESS}/24", "dev", CLIENT_LINK)
        _ip("link", "set", CLIENT_LINK, "up")
        _ip("-n", SWITCH, "link", "set", "v-client", "master", BRIDGE, "up")


def remove_network() -> None:
    """Delete the namespaces (their links go with them) and the client link."""
    _ip("link", "del", CLIENT_LINK, check=False)
    for ns in _namespaces():
        if ns == SWITCH or ns in {namespace(h) for h in ADDRESSES}:
            _ip("netns", "del", ns, check=False)


@dataclass(frozen=True)
class Service:
    """One long-running process on one host."""

    host: str
    command: list[str]
    env: Mapping[str, str]
    ready_url: str | None
    """Polled until it answers 200 (None: the TCP port below accepting is enough)."""
    port: int


class Cluster:
    """The hosts, their configs and their processes, all kept under ``run_dir``."""

    def __init__(
        self,
        run_dir: Path | None = None,
        *,
        data_dir: Path | None = None,
        kv_transport: KvTransport = "tcp",
        gateway_cores: Mapping[str, str] | None = None,
        ready_timeout_s: float = 300.0,
        cache_cluster: bool = False,
    ) -> None:
        """``cache_cluster``: the shared tier is a Redis Cluster on hosts c1-c3 (three
        primaries, two replicas each, no two copies of a slot on one host) instead of one
        redis-server on ``redis``, and the gateways wait for a replica before acknowledging
        a batch submit, a file upload or a ledger flush."""
        self.data_dir = (data_dir or test_data_dir()).resolve()
        self.run_dir = (run_dir or self.data_dir / "cluster").resolve()
        self.kv_transport: KvTransport = kv_transport
        self.gateway_cores = dict(gateway_cores or {})
        self.ready_timeout_s = ready_timeout_s
        self.cache_cluster = cache_cluster
        self.model = self.data_dir / "models" / TINY_MODEL_NAME

    # -- addresses --------------------------------------------------------------------

    @property
    def lb_url(self) -> str:
        return f"http://{address('lb')}:{LB_PORT}"

    def gateway_url(self, host: str) -> str:
        return f"http://{address(host)}:{GATEWAY_PORT}"

    def vllm_url(self, host: str) -> str:
        return f"http://{address(host)}:{VLLM_PORT}"

    @property
    def redis_url(self) -> str:
        if self.cache_cluster:
            nodes = ",".join(f"{address(h)}:{CACHE_PORTS[0]}" for h in CACHE_HOSTS)
            return f"redis+cluster://{nodes}"
        return f"redis://{address('redis')}:{REDIS_PORT}/0"

    @property
    def cache_hosts(self) -> tuple[str, ...]:
        """The hosts of the shared tier."""
        return CACHE_HOSTS if self.cache_cluster else ("redis",)

    def log_path(self, name: str) -> Path:
        return self.run_dir / "logs" / f"{name}.log"

    # -- what runs where ----------------------------------------------------------------

    def services(self) -> dict[str, Service]:
        cache = (
            {cache_node(h, p): self._cache_node(h, p) for h in CACHE_HOSTS for p in CACHE_PORTS}
            if self.cache_cluster
            else {"redis": self._redis()}
        )
        return {
            **cache,
            "p1": self._vllm("p1", "prefill", "0"),
            "d1": self._vllm("d1", "decode", "1"),
            "d2": self._vllm("d2", "decode", "0"),
            **{gw: self._gateway(gw) for gw in GATEWAYS},
            "lb": self._haproxy(),
        }

    def _redis(self) -> Service:
        binary = shutil.which("redis-server") or shutil.which("valkey-server") or "redis-server"
        command = [binary, "--bind", address("redis"), "--port", str(REDIS_PORT)]
        command += ["--protected-mode", "no", "--save", "", "--appendonly", "no"]
        command += ["--dir", str(self.run_dir), "--loglevel", "warning"]
        return Service("redis", command, {}, None, REDIS_PORT)

    def _cache_node(self, host: str, port: int) -> Service:
        binary = shutil.which("redis-server") or shutil.which("valkey-server") or "redis-server"
        directory = self.run_dir / "cache" / cache_node(host, port)
        directory.mkdir(parents=True, exist_ok=True)
        command = [binary, "--bind", address(host), "--port", str(port)]
        command += ["--protected-mode", "no", "--save", "", "--appendonly", "no"]
        command += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        command += ["--cluster-node-timeout", str(CACHE_NODE_TIMEOUT_MS)]
        command += ["--dir", str(directory), "--loglevel", "warning"]
        return Service(host, command, {}, None, port)

    def _cache_cli(self, host: str, port: int, *args: str) -> str:
        cli = shutil.which("redis-cli") or shutil.which("valkey-cli") or "redis-cli"
        done = subprocess.run(
            [cli, "-h", address(host), "-p", str(port), *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return done.stdout.strip()

    def cache_ok(self) -> bool:
        """Every live cache node says ``cluster_state:ok`` with all 16384 slots served."""
        live = [(h, p) for h in CACHE_HOSTS for p in CACHE_PORTS if self.running(cache_node(h, p))]
        for host, port in live:
            info = self._cache_cli(host, port, "cluster", "info")
            if "cluster_state:ok" not in info or "cluster_slots_ok:16384" not in info:
                return False
        return bool(live)

    def create_cache_cluster(self, timeout_s: float = 60.0) -> None:
        """Join the nine nodes into one cluster (once: a kept cluster is left as it is), with
        ``redis-cli --cluster create``, which puts no replica on its primary's host."""
        if not self.cache_ok():
            cli = shutil.which("redis-cli") or shutil.which("valkey-cli") or "redis-cli"
            create = [cli, "--cluster", "create"]
            create += [f"{address(h)}:{p}" for p in CACHE_PORTS for h in CACHE_HOSTS]
            create += ["--cluster-replicas", str(CACHE_REPLICAS), "--cluster-yes"]
            done = subprocess.run(create, capture_output=True, text=True, timeout=timeout_s)
            if done.returncode != 0:
                raise ClusterError(f"cluster create failed: {done.stdout}{done.stderr}")
        self.wait_cache_ok(timeout_s)

    def wait_cache_ok(self, timeout_s: float = 60.0) -> float:
        """Seconds until the shared tier serves every slot again (after a failover, say)."""
        began = time.monotonic()
        while not self.cache_ok():
            if time.monotonic() - began > timeout_s:
                raise ClusterError(f"the cache cluster is not ok after {timeout_s} s")
            time.sleep(0.1)
        return time.monotonic() - began

    def wait_failover(self, key: str, lost: str, timeout_s: float = 60.0) -> float:
        """Seconds until a node other than ``lost`` serves ``key``'s slot as primary and
        every slot is served: the failover after ``lost`` died."""
        began = time.monotonic()
        while self.cache_primary(key) in ("", lost) or not self.cache_ok():
            if time.monotonic() - began > timeout_s:
                raise ClusterError(f"no replica took over from {lost} in {timeout_s} s")
            time.sleep(0.1)
        return time.monotonic() - began

    def cache_primary(self, key: str) -> str:
        """The cache node (service name) that serves ``key``'s slot as primary now."""
        slot = self._cache_cli(CACHE_HOSTS[0], CACHE_PORTS[0], "cluster", "keyslot", key)
        for h in CACHE_HOSTS:
            for p in CACHE_PORTS:
                if not self.running(cache_node(h, p)):
                    continue
                for line in self._cache_cli(h, p, "cluster", "nodes").splitlines():
                    fields = line.split()
                    if "master" not in fields[2] or "fail" in fields[2]:
                        continue
                    for part in fields[8:]:
                        low, _, high = part.partition("-")
                        if low.isdigit() and int(low) <= int(slot) <= int(high or low):
                            node_host, node_port = fields[1].split("@")[0].rsplit(":", 1)
                            return cache_node(host_of(node_host), int(node_port))
                return ""  # one live node's view is enough
        return ""

    def kv_env(self, host: str) -> dict[str, str]:
        """What points NIXL's side channel at the host's address and UCX at its transport."""
        env = {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": address(host),
            "UCX_PROTO_INFO": "y",  # UCX logs the protocol (and transport) each operation uses
        }
        if self.kv_transport == "tcp":
            env.update(UCX_TLS="tcp", UCX_NET_DEVICES="eth0")
        return env

    def _vllm(self, host: str, role: ServerRole, core: str) -> Service:
        server = VllmServer(
            url=self.vllm_url(host),
            role=role,
            launch=single_process_launch(
                cpu_cores=core,
                kv_cache_gib=0.25,
                max_model_len=1024,
                nixl_side_channel_port=NIXL_PORT,
                env=self.kv_env(host),
            ),
        )
        command, env = build_command(
            model=self.model,
            served_model=TINY_MODEL_NAME,
            server=server,
            device=detect_device(),
            python=sys.executable,
        )
        return Service(host, command, env, f"{self.vllm_url(host)}/health", VLLM_PORT)

    def gateway_config(self, host: str) -> str:
        """The gateway's TOML config (gw1 and gw2 differ only in address and data_dir)."""
        q = json.dumps
        return "\n".join(
            [
                f"data_dir = {q(str(self.run_dir / host))}",
                f"policy = {q(str(self.run_dir / 'policy.toml'))}",
                "[server]",
                f"host = {q(address(host))}",
                f"port = {GATEWAY_PORT}",
                "[[auth.tokens]]",
                f"token = {q(TOKEN)}",
                'tenant = "cluster"',
                'roles = ["admin"]',
                "[[auth.tokens]]",
                f"token = {q(METERED_TOKEN)}",
                'tenant = "metered"',
                f"limits = {{ requests_per_minute = {METERED_RPM} }}",
                "[batch.queue]",
                'kind = "redis"',
                f"redis_url = {q(self.redis_url)}",
                "lease_s = 10.0",
                *(("replicas = 1", "[ledger]", "replicas = 1") if self.cache_cluster else ()),
                "[[models]]",
                f"id = {q(MODEL_ID)}",
                'backend = "tiny"',
                f"aliases = [{q(WORKERS_AI_MODEL)}]",
                "[[models]]",
                f"id = {q(SEMANTIC_MODEL_ID)}",
                'backend = "tiny"',
                "[[backends]]",
                'kind = "vllm"',
                'name = "tiny"',
                f"served_model = {q(TINY_MODEL_NAME)}",
                f"model_path = {q(str(self.model))}",
                "prefill_threshold_tokens = 32",
                "health_interval_s = 1.0",
                "read_timeout_s = 120.0",
                'cache_salt_secret = "cluster-salt"',
                "[[backends.servers]]",
                f"url = {q(self.vllm_url('p1'))}",
                'role = "prefill"',
                "[[backends.servers]]",
                f"url = {q(self.vllm_url('d1'))}",
                'role = "decode"',
                "",
            ]
        )

    def policy(self) -> str:
        """The shared cache policy: the embedded defaults, the Redis host as L3, and the
        semantic cache for ``SEMANTIC_MODEL_ID``."""
        return "\n".join(
            [
                "version = 1",
                "[tiers.redis]",
                f"url = {json.dumps(self.redis_url)}",
                f"[models.{json.dumps(SEMANTIC_MODEL_ID)}.routes.chat.semantic]",
                "enabled = true",
                "threshold = 0.9",
                "",
            ]
        )

    def _gateway(self, host: str) -> Service:
        command = [sys.executable, "-m", "server.cli", "serve", "--no-launch"]
        command += ["--config", str(self.run_dir / f"{host}.toml")]
        if core := self.gateway_cores.get(host):
            command = ["taskset", "-c", core, *command]
        env = {"PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        return Service(host, command, env, f"{self.gateway_url(host)}/ready", GATEWAY_PORT)

    def haproxy_config(self) -> str:
        servers = [f"    server {gw} {address(gw)}:{GATEWAY_PORT} check" for gw in GATEWAYS] + [
            f"    use-server {gw} if {{ req.hdr({HOST_HEADER}) -m str {gw} }}" for gw in GATEWAYS
        ]
        return "\n".join(
            [
                "global",
                "    maxconn 4096",
                f"    stats socket {self.run_dir / 'haproxy.sock'} mode 600 level admin",
                "    log stdout format raw local0 info",  # into the lb's log: one line a request
                "defaults",
                "    mode http",
                "    log global",
                "    option httplog",
                "    timeout connect 1s",
                "    timeout client 300s",
                "    timeout server 300s",
                "    timeout check 5s",  # /ready asks every vLLM server: slow on a busy box
                "    retries 3",
                "    option redispatch 1",  # a refused connection is retried on the other gateway
                # A gateway killed while a request reaches it (its socket still open, the
                # process gone) closes without a byte of answer: that request is sent again
                # to the other gateway rather than lost (a dead gateway answered nothing).
                # A 503 from a gateway means nothing was done (e.g. it cannot reach the
                # shared tier): the other gateway may well do it.
                "    retry-on conn-failure empty-response 503",
                # A retry needs the whole request in HAProxy's buffer: without this, a POST
                # already streaming to a dying gateway is answered 502, and a request on a
                # reused keep-alive connection to it is dropped by closing the client's
                # connection (HAProxy's "let the client retry", which POST clients do not).
                "    option http-buffer-request",
                # No gateway ready (e.g. the decode pool is down): the gateways' own answer.
                "    http-error status 503 content-type application/json hdr retry-after 2"
                f" string '{NO_GATEWAY_BODY}'",
                "frontend gateways",
                f"    bind {address('lb')}:{LB_PORT}",
                "    default_backend gateways",
                "backend gateways",
                "    balance roundrobin",
                "    option httpchk GET /ready",
                "    http-check expect status 200",
                f"    http-response set-header {HOST_HEADER} %s",
                "    default-server inter 1s fall 2 rise 1",
                *servers,
                "listen stats",
                f"    bind {address('lb')}:{LB_STATS_PORT}",
                "    stats enable",
                "    stats uri /stats",
                "",
            ]
        )

    def _haproxy(self) -> Service:
        command = ["haproxy", "-db", "-f", str(self.run_dir / "haproxy.cfg")]
        return Service("lb", command, {}, None, LB_PORT)

    def write_configs(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        (self.run_dir / "pids").mkdir(exist_ok=True)
        (self.run_dir / "policy.toml").write_text(self.policy())
        for gw in GATEWAYS:
            (self.run_dir / f"{gw}.toml").write_text(self.gateway_config(gw))
        (self.run_dir / "haproxy.cfg").write_text(self.haproxy_config())

    # -- processes ----------------------------------------------------------------------

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
            self._spawn(name, service.host, service.command, service.env)
        if wait:
            self.wait_ready(name)

    def _spawn(
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
            while self._group_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        self._pid_file(name).unlink(missing_ok=True)

    def unplug(self, host: str) -> None:
        """Take the host off the network (its link down): its peers see timeouts, not
        refused connections, as when a machine dies; its processes keep running."""
        _ip("-n", namespace(host), "link", "set", "eth0", "down")

    def plug(self, host: str) -> None:
        """Put the host back on the network."""
        _ip("-n", namespace(host), "link", "set", "eth0", "up")

    def partition(self, host: str, peer: str) -> None:
        """Cut ``host`` off from ``peer`` alone, both ways: packets between them are dropped
        without a word (a route into each one's loopback, where a foreign address is not
        delivered), so connections time out as across a real partition, and every other
        host stays reachable. (:meth:`impair` makes a slow, lossy link instead.)"""
        for a, b in ((host, peer), (peer, host)):
            _ip("-n", namespace(a), "route", "replace", f"{address(b)}/32", "dev", "lo")

    def heal(self, host: str, peer: str) -> None:
        """Undo :meth:`partition`."""
        for a, b in ((host, peer), (peer, host)):
            _ip("-n", namespace(a), "route", "del", f"{address(b)}/32", check=False)

    def impair(
        self, host: str, peers: Sequence[str], delay_ms: float = 200.0, loss: float = 0.05
    ) -> None:
        """Make the links between ``host`` and each of ``peers`` slow and lossy both ways, as
        ``tc netem delay 200ms loss 5%`` on each end would (this kernel has no netem): the
        packets each end sends the other go through :mod:`harness.netem` in its namespace."""
        ends = {host: [address(p) for p in peers], **{p: [address(host)] for p in peers}}
        for end, targets in ends.items():
            netem.impair(namespace(end), address(end), targets)
            command = [sys.executable, "-m", "harness.netem", "--delay-ms", str(delay_ms)]
            command += ["--loss", str(loss), "--seed", str(ADDRESSES[end])]
            self._spawn(_netem_name(end), end, command)
        deadline = time.monotonic() + 10.0
        while not all(self._carrying(end) for end in ends):  # the device is read
            if time.monotonic() > deadline:
                raise ClusterError(f"netem did not start:\n{self.log_tail(_netem_name(host))}")
            time.sleep(0.05)

    def _carrying(self, end: str) -> bool:
        return self.running(_netem_name(end)) and "netem: sc-slow" in self.current_log(
            _netem_name(end)
        )

    def repair(self, host: str, peers: Sequence[str]) -> None:
        """Undo :meth:`impair`."""
        for end in (host, *peers):
            self.stop(_netem_name(end))
            netem.repair(namespace(end))  # the routes go with the device

    def kill(self, name: str) -> None:
        """``kill -9`` of the whole process group: no shutdown, connections just die."""
        self.stop(name, signal.SIGKILL, grace_s=5.0)

    @staticmethod
    def _group_alive(pgid: int) -> bool:
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                    return True
        return False

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

    # -- the whole cluster ----------------------------------------------------------------

    def up(self, names: Iterable[str] | None = None) -> None:
        """Build what is missing and start what is not running (all of it by default)."""
        missing = missing_requirements()
        if missing:
            raise ClusterError("cannot build the cluster, missing: " + ", ".join(missing))
        build_tiny_llama(self.model)
        self.write_configs()
        build_network()
        for host in ADDRESSES:
            self.plug(host)
        order = list(names or [n for n in self.services() if n not in SPARES])
        cache = [n for n in order if self.services()[n].host in CACHE_HOSTS]
        try:
            for name in cache:  # the shared tier first: gateways read it as they start
                self.start(name, wait=False)
            for name in cache:
                self.wait_ready(name)
            if cache:
                self.create_cache_cluster()
            for name in order:
                self.start(name, wait=False)
            for name in order:
                self.wait_ready(name)
            if "lb" in order:
                self.wait_lb(len([g for g in GATEWAYS if g in order]))
        except BaseException:
            self.down()
            raise

    def wait_lb(self, gateways: int, timeout_s: float = 30.0) -> None:
        """Until the LB sees ``gateways`` gateways up (its health checks passed)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self.lb_servers_up()) >= gateways:
                return
            time.sleep(0.2)
        raise ClusterError(f"the LB sees {self.lb_servers_up()} up, wanted {gateways}")

    def lb_command(self, command: str) -> str:
        """One command on HAProxy's runtime API (e.g. ``disable server gateways/gw2``)."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5.0)
            sock.connect(str(self.run_dir / "haproxy.sock"))
            sock.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def lb_servers_up(self) -> list[str]:
        """The gateways HAProxy currently sends traffic to."""
        try:
            csv = self.lb_command("show stat")
        except OSError:
            return []
        up = []
        for line in csv.splitlines():
            fields = line.split(",")
            if len(fields) > 17 and fields[0] == "gateways" and fields[1] in GATEWAYS:
                if fields[17].startswith("UP"):
                    up.append(fields[1])
        return up

    def down(self) -> None:
        """Stop every process a pid file names (the LB first), delete the network and the
        gateways' data directories."""
        for name in ("lb", *GATEWAYS, "p1", "d1", *SPARES, "redis"):
            self.stop(name)
        for host in ADDRESSES:
            self.stop(_netem_name(host))
        for host in CACHE_HOSTS:
            for port in CACHE_PORTS:
                self.stop(cache_node(host, port))
        shutil.rmtree(self.run_dir / "cache", ignore_errors=True)  # nodes.conf: a new cluster
        remove_network()
        for gw in GATEWAYS:  # their local tiers: a cache of Redis's, rebuilt on the next start
            shutil.rmtree(self.run_dir / gw, ignore_errors=True)

    def status(self) -> dict[str, bool]:
        return {name: self.running(name) for name in self.services()}

    def where(self, name: str) -> str:
        """The address ``name`` listens on."""
        service = self.services()[name]
        return f"{address(service.host)}:{service.port}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.cluster", description="the cluster")
    ap.add_argument("action", choices=["up", "down", "status", "requirements"])
    ap.add_argument("--run-dir", type=Path, default=None, help="default: .data/test/cluster")
    ap.add_argument("--kv-transport", choices=["tcp", "shm"], default="tcp")
    ap.add_argument(
        "--cache-cluster",
        action="store_true",
        help="the shared tier as a Redis Cluster on hosts c1-c3 (3 primaries, 2 replicas each)",
    )
    args = ap.parse_args(argv)
    if args.action == "requirements":
        missing = missing_requirements()
        print("missing: " + ", ".join(missing) if missing else "everything is here")
        return 1 if missing else 0
    cluster = Cluster(
        args.run_dir, kv_transport=args.kv_transport, cache_cluster=args.cache_cluster
    )
    if args.action == "down":
        cluster.down()
        print("cluster down")
        return 0
    if args.action == "up":
        try:
            cluster.up()
        except ClusterError as exc:
            print(f"cluster: {exc}", file=sys.stderr)
            return 1
        print(f"cluster up: LB {cluster.lb_url}, token {TOKEN}, logs {cluster.run_dir / 'logs'}")
    for name, running in cluster.status().items():
        print(f"{name:8} {cluster.where(name):18} {'up' if running else 'down'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
