"""The dispatch gate: a server whose vLLM reports it is short takes no new request.

Besides its concurrency limit (the gateway's own count of what it runs there), a server is
held when the last scrape of its ``/metrics`` says vLLM queues more requests of its own than
a threshold (``vllm:num_requests_waiting``; 0: any) or its KV cache is fuller than one
(``vllm:kv_cache_usage_perc``): the backend's ``hold_above_waiting`` and
``hold_above_kv_usage``, both off by default. A held server's requests wait in the
gateway's fair queue (bands, tenant shares) instead of in vLLM's first-come line, where no
band or share exists.

The gate is refreshed after each scrape (``refresh``: one walk of the samples per server per
health interval), and a request reads one flag (``ServerState.held``). Scrapes are one
health interval old at most, so the gate never holds a server the gateway runs nothing on:
its signals predate the gateway's last requests there, and holding it would idle the server
until the next scrape.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from backends.fleet.pool import Pool
from backends.fleet.server_state import ServerState
from backends.scraped_metrics import UpstreamSample

WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"


class ServerSignals(msgspec.Struct, frozen=True, kw_only=True):
    """What a server's vLLM last said of its load (None: not reported)."""

    waiting: float | None = None
    kv_usage: float | None = None
    """0..1."""


SignalSource = Callable[[ServerState], ServerSignals]
"""Where the gate reads a server's signals (the scraped page; a fake in tests)."""


def _total(samples: list[UpstreamSample], name: str) -> float | None:
    values = [s.value for s in samples if s.name == name]
    return sum(values) if values else None


def scraped_signals(server: ServerState) -> ServerSignals:
    """A server's signals from its last scraped ``/metrics`` page."""
    return ServerSignals(
        waiting=_total(server.upstream, WAITING), kv_usage=_total(server.upstream, KV_USAGE)
    )


class DispatchGate:
    """Holds the servers of a pool whose signals say they are short."""

    def __init__(
        self,
        *,
        max_waiting: int | None,
        max_kv_usage: float | None,
        source: SignalSource = scraped_signals,
    ) -> None:
        self.max_waiting = max_waiting
        self.max_kv_usage = max_kv_usage
        self.source = source

    @property
    def active(self) -> bool:
        return self.max_waiting is not None or self.max_kv_usage is not None

    def holds(self, signals: ServerSignals) -> bool:
        """Whether a server with these signals should take nothing new."""
        if (
            self.max_waiting is not None
            and signals.waiting is not None
            and signals.waiting > self.max_waiting
        ):
            return True
        return (
            self.max_kv_usage is not None
            and signals.kv_usage is not None
            and signals.kv_usage > self.max_kv_usage
        )

    def refresh(self, pool: Pool) -> None:
        """Re-read every server of ``pool``; a server let go wakes the pool's waiters."""
        if not self.active:
            return
        released = False
        for server in pool.servers:
            held = self.holds(self.source(server))
            released |= server.held and not held
            server.held = held
        if released:
            pool.admission.wake_all()
