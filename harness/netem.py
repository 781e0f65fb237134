"""A slow, lossy link for the namespaced cluster, in user space: what ``tc netem delay 200ms
loss 5%`` does, on a kernel without netem.

Run inside a host's namespace, it owns a TUN device (made by :func:`impair`) that the host
routes some peers through. Every IP packet the host sends to those peers comes out of the
device here; each is dropped with probability ``loss`` or, ``delay`` later, sent on through
a raw socket bound to ``eth0`` (a socket bound to a device takes only that device's routes,
so the packet leaves by the host's real link and not back into the device). The packets are
the kernel's own (TCP segments, SYNs, ACKs), so a lost one is recovered the way TCP recovers
it, by retransmission, and a constant delay keeps their order, as netem's does.

    ip netns exec sc-gw1 python -m harness.netem --device sc-slow --delay-ms 200 --loss 0.05
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import random
import signal
import socket
import struct
import subprocess
from collections.abc import Sequence

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
DEVICE = "sc-slow"


def open_tun(name: str) -> int:
    """The file descriptor of the (existing) TUN device ``name``, packets without a prefix."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def raw_sender(link: str) -> socket.socket:
    """A socket that sends whole IP packets (headers included) out of ``link``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, link.encode())
    sock.setblocking(False)
    return sock


class Link:
    """Forwards packets from the TUN device to the real link, ``delay_s`` late, dropping a
    ``loss`` share of them."""

    def __init__(self, tun: int, out: socket.socket, delay_s: float, loss: float, seed: int):
        self.gone = asyncio.Event()
        """Set when the device was removed under it."""
        self.tun = tun
        self.out = out
        self.delay_s = delay_s
        self.loss = loss
        self.random = random.Random(seed)
        self.sent = self.dropped = 0

    def readable(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                packet = os.read(self.tun, 65535)
            except BlockingIOError:
                return
            except OSError:  # the device was deleted
                loop.remove_reader(self.tun)
                self.gone.set()
                return
            if len(packet) < 20 or packet[0] >> 4 != 4:
                continue  # IPv4 only (the cluster's network)
            if self.random.random() < self.loss:
                self.dropped += 1
                continue
            loop.call_later(self.delay_s, self.send, packet)

    def send(self, packet: bytes) -> None:
        destination = socket.inet_ntoa(packet[16:20])
        try:
            self.out.sendto(packet, (destination, 0))
            self.sent += 1
        except OSError:
            self.dropped += 1  # a full socket buffer drops, as a full queue would


async def serve(device: str, link: str, delay_s: float, loss: float, seed: int) -> None:
    tun = open_tun(device)
    forwarder = Link(tun, raw_sender(link), delay_s, loss, seed)
    loop = asyncio.get_running_loop()
    stopped = forwarder.gone
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopped.set)
    loop.add_reader(tun, forwarder.readable)
    print(f"netem: {device} -> {link}, delay {delay_s * 1000:.0f} ms, loss {loss:.1%}", flush=True)
    await stopped.wait()
    print(f"netem: sent {forwarder.sent}, dropped {forwarder.dropped}", flush=True)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def impair(namespace: str, own_address: str, peers: Sequence[str]) -> None:
    """Make the TUN device in ``namespace`` and route ``peers`` through it (the host keeps
    ``own_address`` as the packets' source). Run :mod:`harness.netem` there to carry them."""
    _ip("-n", namespace, "tuntap", "add", "dev", DEVICE, "mode", "tun")
    _ip("-n", namespace, "link", "set", DEVICE, "up")
    for peer in peers:
        _ip("-n", namespace, "route", "replace", f"{peer}/32", "dev", DEVICE, "src", own_address)


def repair(namespace: str) -> None:
    """Remove the device (and with it the routes through it)."""
    subprocess.run(["ip", "-n", namespace, "link", "del", DEVICE], capture_output=True, check=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.netem", description=__doc__)
    parser.add_argument("--device", default=DEVICE)
    parser.add_argument("--link", default="eth0")
    parser.add_argument("--delay-ms", type=float, default=200.0)
    parser.add_argument("--loss", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    asyncio.run(serve(args.device, args.link, args.delay_ms / 1000.0, args.loss, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
