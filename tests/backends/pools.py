"""Pools of fake servers for the backend tests that run without vLLM."""

from __future__ import annotations

from backends.config import VllmServer
from backends.fleet.pool import Pool
from backends.fleet.server_state import ServerState


def make_pool(
    limits: list[int],
    *,
    max_queue: int = 2,
    timeout_s: float = 5.0,
    urls: list[str] | None = None,
) -> Pool:
    """A decode pool of backend ``b``, one server per limit (the URLs need not answer)."""
    urls = urls or [f"http://127.0.0.1:{9000 + i}" for i in range(len(limits))]
    states = [
        ServerState(VllmServer(url=url, role="decode"), limit=n)
        for url, n in zip(urls, limits, strict=True)
    ]
    return Pool(
        "b",
        "decode",
        states,
        max_queue=max_queue,
        queue_timeout_s=timeout_s,
        retry_after_s=2,
        unavailable_retry_after_s=5,
    )
