"""One vLLM server as the gateway sees it: its limit, load, health and counters."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

from backends.config import ServerRole, VllmServer
from backends.scraped_metrics import UpstreamSample


@dataclass(eq=False, slots=True)
class ServerState:
    """One vLLM server as the gateway sees it (slotted: placement reads a few of its fields
    for every server of a pool on every request)."""

    config: VllmServer
    limit: int
    inflight: int = 0
    pending_tokens: int = 0
    """Prompt tokens this gateway's open requests still have the server compute (KV
    placement's prediction, dropped at each request's first token): its prefill backlog."""
    healthy: bool = True
    health_failures: int = 0
    requests: int = 0
    ejections: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    upstream: list[UpstreamSample] = field(default_factory=list)
    previous_upstream: list[UpstreamSample] = field(default_factory=list)
    """The scrape before ``upstream``: the two give recent averages of vLLM's histograms."""
    idle: asyncio.Event | None = None
    """Set while the server drains, by the release of its last request."""
    held: bool = False
    """The dispatch gate holds it: its vLLM queues or its KV cache is full
    (``backends.fleet.dispatch_gate``)."""
    url: str = field(init=False)
    """The config's url without its trailing slash, the server's name everywhere."""

    def __post_init__(self) -> None:
        self.url = self.config.url.rstrip("/")

    @property
    def role(self) -> ServerRole:
        return self.config.role

    @property
    def free(self) -> bool:
        # a held server still takes a request when the gateway runs none there: the gate's
        # signals are older than the gateway's last request to it
        return self.healthy and self.inflight < self.limit and not (self.held and self.inflight)


@dataclass(frozen=True)
class ServerLoad:
    """A server's load as the batch queue and dashboards read it."""

    url: str
    role: ServerRole
    inflight: int
    limit: int
    healthy: bool
