"""The hosts' network: one namespace per host on a bridge, and the machine's link to it.

Built with iproute2's ``ip`` (root). What exists is kept, so building twice is harmless.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from harness.cluster.topology import (
    ADDRESSES,
    CLIENT_ADDRESS,
    PREFIX,
    ClusterError,
    address,
    namespace,
)

SWITCH = f"{PREFIX}switch"
BRIDGE = "br0"
CLIENT_LINK = f"{PREFIX}client"


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


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``ip ARGS``; ``ClusterError`` with its message when it fails and ``check``."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise ClusterError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _namespaces() -> set[str]:
    out = ip("netns", "list").stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def build_network() -> None:
    """The switch, one namespace per host and the client link (what exists is kept)."""
    existing = _namespaces()
    if SWITCH not in existing:
        ip("netns", "add", SWITCH)
        ip("-n", SWITCH, "link", "add", BRIDGE, "type", "bridge")
        ip("-n", SWITCH, "link", "set", BRIDGE, "up")
    for host in ADDRESSES:
        ns, port = namespace(host), f"v-{host}"
        if ns not in existing:
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
        if ip("-n", ns, "link", "show", "eth0", check=False).returncode != 0:
            ip("-n", SWITCH, "link", "del", port, check=False)
            ip("link", "add", port, "netns", SWITCH, "type", "veth", "peer", "eth0", "netns", ns)
            ip("-n", ns, "addr", "add", f"{address(host)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", SWITCH, "link", "set", port, "master", BRIDGE, "up")
    if ip("link", "show", CLIENT_LINK, check=False).returncode != 0:
        ip("link", "add", CLIENT_LINK, "type", "veth", "peer", "v-client", "netns", SWITCH)
        ip("addr", "add", f"{CLIENT_ADDRESS}/24", "dev", CLIENT_LINK)
        ip("link", "set", CLIENT_LINK, "up")
        ip("-n", SWITCH, "link", "set", "v-client", "master", BRIDGE, "up")


def remove_network() -> None:
    """Delete the namespaces (their links go with them) and the client link."""
    ip("link", "del", CLIENT_LINK, check=False)
    for ns in _namespaces():
        if ns == SWITCH or ns in {namespace(h) for h in ADDRESSES}:
            ip("netns", "del", ns, check=False)
