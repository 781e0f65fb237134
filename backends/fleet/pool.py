"""The servers of one vLLM backend as pools: one per role, with admission and health state.

A pool is the servers of one role (monolithic ``both``, ``prefill`` or ``decode``). Requests
get a slot on one of them through the pool's ``admission`` (``backends.fleet.admission``: limits,
a bounded wait queue, 429/503 refusals). A server is ejected when it refuses connections, or
fails three health checks in a row without answering any request in between
(``backends.fleet.health``); the first health check it passes re-admits it.

Servers join (``add``) and leave (``drain``) a pool while it serves. A draining server leaves
the pool's list at once, so placement and admission (which read that list) send it nothing
new; the requests it runs keep their lease and finish there, and the release of its last one
sets its ``idle`` event.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence

from backends.config import ServerRole, VllmBackendConfig
from backends.fleet.admission import SlotAdmission
from backends.fleet.server_state import ServerLoad, ServerState
from backends.interfaces import BackendError

log = logging.getLogger("semcache.backends")

PoolRole = ServerRole


class Pool:
    """The servers of one role: who is healthy, their load, and the admission to them."""

    def __init__(
        self,
        backend: str,
        role: PoolRole,
        servers: Sequence[ServerState],
        *,
        max_queue: int,
        queue_timeout_s: float,
        retry_after_s: int,
        unavailable_retry_after_s: int,
    ) -> None:
        self.backend = backend
        self.role = role
        self.servers = list(servers)
        """The serving servers (admitted or ejected); shared with ``admission``: edited in
        place."""
        self._leaving: list[ServerState] = []
        self.admission = SlotAdmission(
            backend,
            role,
            self.servers,
            max_queue=max_queue,
            queue_timeout_s=queue_timeout_s,
            retry_after_s=retry_after_s,
            unavailable_retry_after_s=unavailable_retry_after_s,
        )

    def find(self, url: str) -> ServerState | None:
        """The serving server at ``url``."""
        url = url.rstrip("/")
        return next((s for s in self.servers if s.url == url), None)

    def leaving(self) -> list[ServerState]:
        """Draining servers that still run requests."""
        self._leaving = [s for s in self._leaving if s.inflight]
        return list(self._leaving)

    def add(self, server: ServerState) -> None:
        """``server`` takes requests from now on (a health check may still eject it)."""
        if server.role != self.role:
            raise ValueError(f"a {server.role} server cannot join the {self.role} pool")
        if self.find(server.url) is not None:
            raise ValueError(f"{server.url} already serves in this pool")
        if any(s.url == server.url for s in self.leaving()):
            raise ValueError(f"{server.url} is still draining; add it again once it has left")
        self.servers.append(server)
        log.warning("backend %s: %s server %s added", self.backend, self.role, server.url)
        self.admission.wake_all()  # waiters re-rank: a free server came

    def drain(self, server: ServerState) -> None:
        """Send ``server`` nothing new; what it runs finishes there (see ``wait_drained``)."""
        self.servers.remove(server)
        if server.inflight:
            server.idle = asyncio.Event()
            self._leaving.append(server)
        log.warning(
            "backend %s: %s server %s drains (%d in flight)",
            self.backend,
            self.role,
            server.url,
            server.inflight,
        )
        self.admission.wake_all()  # waiters re-check: maybe nothing is left

    async def wait_drained(self, server: ServerState, timeout_s: float) -> bool:
        """Wait until a draining ``server`` runs nothing; False if it still does after
        ``timeout_s`` (it stays draining)."""
        if server.idle is None or not server.inflight:
            return True
        try:
            async with asyncio.timeout(timeout_s):
                await server.idle.wait()
        except TimeoutError:
            return False
        return True

    def healthy(self) -> list[ServerState]:
        return [s for s in self.servers if s.healthy]

    def has_capacity(self, per_server_limit: int | None = None) -> bool:
        """Some healthy server runs fewer requests than its limit (or ``per_server_limit``)."""
        return any(
            s.healthy and s.inflight < min(s.limit, per_server_limit or s.limit)
            for s in self.servers
        )

    def loads(self) -> list[ServerLoad]:
        return [ServerLoad(s.url, s.role, s.inflight, s.limit, s.healthy) for s in self.servers]

    def eject(self, server: ServerState) -> None:
        """Stop sending requests to ``server`` until a health check passes."""
        if server.healthy:
            server.healthy = False
            server.ejections += 1
            log.warning("backend %s: %s server %s ejected", self.backend, self.role, server.url)
            self.admission.wake_all()  # waiters re-check: maybe nothing is left

    def answered(self, server: ServerState) -> None:
        """``server`` just answered a request: it is alive, whatever its health checks said."""
        server.health_failures = 0

    def failed(self, server: ServerState, failure: BackendError) -> None:
        """A request to ``server`` failed: count it; an unreachable server is ejected."""
        server.errors[failure.kind] += 1
        if failure.kind == "unreachable":
            self.eject(server)  # the health checks re-admit it when it answers again

    def readmit(self, server: ServerState) -> None:
        server.health_failures = 0
        if not server.healthy:
            server.healthy = True
            log.warning("backend %s: %s server %s re-admitted", self.backend, self.role, server.url)
            self.admission.wake_all()


def build_pools(config: VllmBackendConfig) -> tuple[Pool | None, Pool]:
    """``(prefill pool or None, the pool that answers)`` for a backend's servers."""

    def states(role: ServerRole) -> list[ServerState]:
        return [
            ServerState(s, s.max_inflight or config.max_inflight_per_server)
            for s in config.servers
            if s.role == role
        ]

    common = {
        "max_queue": config.max_queue,
        "queue_timeout_s": config.queue_timeout_s,
        "retry_after_s": config.retry_after_s,
        "unavailable_retry_after_s": max(1, math.ceil(config.health_interval_s)),
    }
    decode_servers = states("decode")
    if not decode_servers:
        both = states("both")
        if not both:
            raise ValueError(f"backend {config.name!r} has no servers")
        return None, Pool(config.name, "both", both, **common)  # type: ignore[arg-type]
    # Empty when the config names no prefill server: servers may join it while serving.
    prefill = Pool(config.name, "prefill", states("prefill"), **common)  # type: ignore[arg-type]
    return prefill, Pool(config.name, "decode", decode_servers, **common)  # type: ignore[arg-type]
