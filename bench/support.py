"""What the bench scripts share: percentiles, bootstrap intervals, progress lines, exit
statuses, CPU pinning and asking a server for its model name."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

import httpx
import numpy as np

INTERRUPTED = 130
"""The exit status of a run stopped with Ctrl-C (as a shell reports SIGINT)."""


def pct(values: Sequence[float] | np.ndarray, p: float) -> float:
    """The ``p``-th percentile (0-100, linear interpolation) of ``values``; NaN when empty."""
    return float(np.percentile(values, p)) if len(values) else float("nan")


def pct_ms(seconds: Sequence[float] | np.ndarray, p: float) -> float:
    """``pct`` of durations in seconds, in milliseconds."""
    return pct(seconds, p) * 1000.0


def bootstrap_interval(
    statistic: Callable[[np.random.Generator], float],
    *,
    rounds: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile interval (``level``, two-sided) of ``statistic`` over ``rounds`` resamplings.

    ``statistic(rng)`` draws its own resample (with replacement, e.g. ``rng.integers(0, n, n)``)
    and returns the figure of it, or NaN when that resample has none (such rounds are dropped).
    """
    rng = np.random.default_rng(seed)
    values = np.array([statistic(rng) for _ in range(rounds)])
    values = values[~np.isnan(values)]
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def stderr_printer(tag: str) -> Callable[[str], None]:
    """A ``say(message)`` that writes ``[tag] message`` to stderr at once (progress lines)."""

    def say(message: str) -> None:
        print(f"[{tag}] {message}", file=sys.stderr, flush=True)

    return say


def exit_status(run: Coroutine[Any, Any, bool], say: Callable[[str], None]) -> int:
    """Run ``run`` to the end: 0 when it returns True (every target met), 1 when False, and
    ``INTERRUPTED`` on Ctrl-C (what the run started is stopped by its own clean-up)."""
    try:
        met = asyncio.run(run)
    except (KeyboardInterrupt, asyncio.CancelledError):
        say("interrupted; everything started here is stopped")
        return INTERRUPTED
    return 0 if met else 1


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
