"""What a live test prints when a wait on a gateway process runs out: the end of its log
and the metric families the wait was about."""

from __future__ import annotations

from harness.gateway import GatewayProcess

FAMILIES = ("semcache_batch", "semcache_pool", "semcache_backend")
GAUGES = (
    "semcache_batch_running",
    "semcache_backend_server_inflight",
    "semcache_backend_server_healthy",
    "semcache_backend_queue_waiting",
)
"""The gauges whose values lead the message: its first line is all a short summary shows."""


def gateway_state(
    name: str, gateway: GatewayProcess, metrics: str, families: tuple[str, ...] = FAMILIES
) -> str:
    """The gauges of ``GAUGES`` on one line, then the last log lines of ``gateway`` and the
    lines of ``metrics`` (its ``/metrics`` page) that belong to ``families``."""
    lines = [line for line in metrics.splitlines() if line.startswith(families)]
    gauges = [line for line in lines if line.startswith(GAUGES)]
    return (
        f" [{name}: {'; '.join(gauges)}]"
        f"\n--- {name} log:\n" + "".join(gateway.lines[-30:]) + "--- metrics:\n" + "\n".join(lines)
    )
