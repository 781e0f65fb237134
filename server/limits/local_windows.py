"""Fixed rate windows counted in this process, for a gateway without a shared store.

The same windows as the `limits` library's ``FixedWindowRateLimiter`` on its memory storage
(a key's window opens at the count that takes it from zero and lasts its expiry; a count
back at zero reopens it), counted in a dict and synchronously: the library's asynchronous
memory storage wraps each call in its error translation and an ``asyncio.Lock``, several
microseconds per request that an in-process counter does not need. Redis, shared by gateways,
stays with the library (``windows``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

_SWEEP_EVERY = 4096
"""Counts between two sweeps of the windows that have ended."""


class LocalWindows:
    """Counters with an end each, on ``clock`` (ended ones read as zero, swept now and then)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._windows: dict[str, list[float]] = {}
        """Storage key → [count, end]."""
        self._until_sweep = _SWEEP_EVERY

    def incr(self, key: str, expiry: float, amount: int) -> tuple[int, float]:
        """Add ``amount`` to the window at ``key``; its count and end after that."""
        now = self.clock()
        window = self._windows.get(key)
        if window is None or window[1] <= now:
            window = self._windows[key] = [0, now + expiry]
            self._sweep()
        window[0] += amount
        if window[0] == amount:  # the count left zero: the window opens now
            window[1] = now + expiry
        return int(window[0]), window[1]

    def get(self, key: str) -> tuple[int, float]:
        """The count and end of the window at ``key`` (zero and now when none is open)."""
        now = self.clock()
        window = self._windows.get(key)
        if window is None or window[1] <= now:
            return 0, now
        return int(window[0]), window[1]

    def __len__(self) -> int:
        return len(self._windows)

    def _sweep(self) -> None:
        self._until_sweep -= 1
        if self._until_sweep > 0:
            return
        self._until_sweep = _SWEEP_EVERY
        now = self.clock()
        for key in [k for k, w in self._windows.items() if w[1] <= now]:
            del self._windows[key]
