"""Helpers the bench scripts share: CPU pinning and asking a server for its model name."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import httpx


def parse_cores(spec: str) -> set[int]:
    """``"1"``, ``"0,2"``, ``"2-3"`` → a set of core numbers."""
    cores: set[int] = set()
    for part in spec.split(","):
        low, _, high = part.strip().partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return cores


@contextlib.contextmanager
def affinity(cores: set[int] | None) -> Iterator[None]:
    """Run the block on ``cores`` (a process started inside inherits them)."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


async def served_model_of(url: str) -> str:
    """The first model id an OpenAI-protocol server lists."""
    async with httpx.AsyncClient(timeout=10.0) as client:
        response = await client.get(f"{url}/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
