"""Bounded polls for tests: wait for the condition a test expects instead of a fixed sleep."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


def wait_until(
    predicate: Callable[[], object], timeout_s: float = 10.0, interval_s: float = 0.02
) -> None:
    """Call ``predicate`` until it returns something true; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"not true after {timeout_s} s: {_name(predicate)}")
        time.sleep(interval_s)


async def wait_until_async(
    predicate: Callable[[], object | Awaitable[object]],
    timeout_s: float = 10.0,
    interval_s: float = 0.02,
) -> None:
    """The async twin of :func:`wait_until`; ``predicate`` may be a coroutine function."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"not true after {timeout_s} s: {_name(predicate)}")
        await asyncio.sleep(interval_s)


def _name(predicate: object) -> str:
    return str(getattr(predicate, "__qualname__", None) or repr(predicate))
