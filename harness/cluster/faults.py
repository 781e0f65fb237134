"""Faults the tests inject between hosts: a host off the network, two hosts cut off from
each other, a slow and lossy link. (A process killed outright is ``Processes.kill``.)"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from harness import netem
from harness.cluster.network import ip
from harness.cluster.processes import Processes
from harness.cluster.topology import ADDRESSES, ClusterError, address, namespace


def netem_name(host: str) -> str:
    """The service name of the process carrying ``host``'s impaired packets."""
    return f"netem-{host}"


def unplug(host: str) -> None:
    """Take the host off the network (its link down): its peers see timeouts, not refused
    connections, as when a machine dies; its processes keep running."""
    ip("-n", namespace(host), "link", "set", "eth0", "down")


def plug(host: str) -> None:
    """Put the host back on the network."""
    ip("-n", namespace(host), "link", "set", "eth0", "up")


def partition(host: str, peer: str) -> None:
    """Cut ``host`` off from ``peer`` alone, both ways: packets between them are dropped
    without a word (a route into each one's loopback, where a foreign address is not
    delivered), so connections time out as across a real partition, and every other host
    stays reachable. (:func:`impair` makes a slow, lossy link instead.)"""
    for a, b in ((host, peer), (peer, host)):
        ip("-n", namespace(a), "route", "replace", f"{address(b)}/32", "dev", "lo")


def heal(host: str, peer: str) -> None:
    """Undo :func:`partition`."""
    for a, b in ((host, peer), (peer, host)):
        ip("-n", namespace(a), "route", "del", f"{address(b)}/32", check=False)


def impair(
    processes: Processes,
    host: str,
    peers: Sequence[str],
    delay_ms: float = 200.0,
    loss: float = 0.05,
) -> None:
    """Make the links between ``host`` and each of ``peers`` slow and lossy both ways, as
    ``tc netem delay 200ms loss 5%`` on each end would (this kernel has no netem): the
    packets each end sends the other go through :mod:`harness.netem` in its namespace."""
    ends = {host: [address(p) for p in peers], **{p: [address(host)] for p in peers}}
    for end, targets in ends.items():
        netem.impair(namespace(end), address(end), targets)
        command = [sys.executable, "-m", "harness.netem", "--delay-ms", str(delay_ms)]
        command += ["--loss", str(loss), "--seed", str(ADDRESSES[end])]
        processes.spawn(netem_name(end), end, command)

    def carrying(end: str) -> bool:  # the device is read
        name = netem_name(end)
        return processes.running(name) and "netem: sc-slow" in processes.current_log(name)

    deadline = time.monotonic() + 10.0
    while not all(carrying(end) for end in ends):
        if time.monotonic() > deadline:
            raise ClusterError(f"netem did not start:\n{processes.log_tail(netem_name(host))}")
        time.sleep(0.05)


def repair(processes: Processes, host: str, peers: Sequence[str]) -> None:
    """Undo :func:`impair`."""
    for end in (host, *peers):
        processes.stop(netem_name(end))
        netem.repair(namespace(end))  # the routes go with the device
