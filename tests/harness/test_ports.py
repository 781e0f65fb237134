"""Ports for the servers tests start: free, and out of the kernel's ephemeral range."""

from __future__ import annotations

import itertools
import socket

import pytest

from harness import ports


def test_a_free_port_is_bindable_and_below_the_ephemeral_range() -> None:
    start = ports.ephemeral_start()
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOWEST <= port < start
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        with socket.socket() as probe:  # a port free a moment ago (taken - 1 may not be)
            probe.bind(("127.0.0.1", 0))
            spare = probe.getsockname()[1]
        picks = itertools.chain([taken, taken], itertools.repeat(spare))

        class Picks:
            def randrange(self, low: int, high: int) -> int:
                return next(picks)

        monkeypatch.setattr(ports.random, "SystemRandom", Picks)
        monkeypatch.setattr(ports, "ephemeral_start", lambda: 65_536)
        assert ports.free_port() == spare
