"""The load balancer on ``lb``: HAProxy in front of gw1 and gw2, its config and its runtime
API (which gateways it sends traffic to; one taken out for maintenance)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from harness.cluster.processes import Service
from harness.cluster.topology import (
    GATEWAY_PORT,
    GATEWAYS,
    HOST_HEADER,
    LB_PORT,
    LB_STATS_PORT,
    ClusterError,
    address,
)

NO_GATEWAY_BODY = (
    '{"error":{"message":"No gateway is ready to answer.","type":"server_error",'
    '"param":null,"code":"backend_unavailable"}}'
)
"""What the LB answers (503, ``Retry-After``) when no gateway passes its health check."""


def lb_url() -> str:
    return f"http://{address('lb')}:{LB_PORT}"


def haproxy_config(run_dir: Path) -> str:
    servers = [f"    server {gw} {address(gw)}:{GATEWAY_PORT} check" for gw in GATEWAYS] + [
        f"    use-server {gw} if {{ req.hdr({HOST_HEADER}) -m str {gw} }}" for gw in GATEWAYS
    ]
    return "\n".join(
        [
            "global",
            "    maxconn 4096",
            f"    stats socket {run_dir / 'haproxy.sock'} mode 600 level admin",
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


def haproxy_service(run_dir: Path) -> Service:
    command = ["haproxy", "-db", "-f", str(run_dir / "haproxy.cfg")]
    return Service("lb", command, {}, None, LB_PORT)


class LoadBalancer:
    """HAProxy's runtime API, on its socket under ``run_dir``."""

    def __init__(self, run_dir: Path) -> None:
        self.socket = run_dir / "haproxy.sock"

    def command(self, command: str) -> str:
        """One command (e.g. ``disable server gateways/gw2``); its answer."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5.0)
            sock.connect(str(self.socket))
            sock.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def servers_up(self) -> list[str]:
        """The gateways HAProxy currently sends traffic to."""
        try:
            csv = self.command("show stat")
        except OSError:
            return []
        up = []
        for line in csv.splitlines():
            fields = line.split(",")
            if len(fields) > 17 and fields[0] == "gateways" and fields[1] in GATEWAYS:
                if fields[17].startswith("UP"):
                    up.append(fields[1])
        return up

    def wait(self, gateways: int, timeout_s: float = 30.0) -> None:
        """Until HAProxy sees ``gateways`` gateways up (their health checks passed)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self.servers_up()) >= gateways:
                return
            time.sleep(0.2)
        raise ClusterError(f"the LB sees {self.servers_up()} up, wanted {gateways}")
