"""Free TCP ports for servers a test or benchmark starts on 127.0.0.1."""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10_000
"""The lowest port handed out (below it: well-known and registered services)."""


def ephemeral_start() -> int:
    """Where the kernel's ephemeral range begins (ports it gives to ``bind(0)`` and outgoing
    connections); 32768 when it cannot be read."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now, below the kernel's ephemeral range.

    A port the OS picks (``bind(0)``) comes from the ephemeral range, where any process may
    be given it next (an outgoing connection, a library binding port 0) before the server it
    was picked for binds it: a vLLM server lost its NIXL side-channel port that way to its
    partner's ephemeral socket. Below that range only explicit binds take ports.
    """
    top = ephemeral_start()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(LOWEST, top) if top > LOWEST else 0
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    with socket.socket() as sock:  # no luck below the range: let the OS pick
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
