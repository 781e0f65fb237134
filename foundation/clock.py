"""A wall clock an operator can move: ``[debug] adjustable_clock`` on a staging gateway.

Everything that reads calendar time through the app's clock (the answer cache's ages,
TTLs and stale windows; the budgets' days and months; the usage ledger's days) sees the
same moved time, so a policy's expiry or a budget's rollover can be watched without
waiting. Rate windows keep their storage's own clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec


class ClockState(msgspec.Struct, kw_only=True):
    now: float
    """Seconds since the epoch, as the gateway reads them."""
    offset_s: float
    """How far the gateway's time is ahead of the system's (while running)."""
    frozen: bool


class AdjustableClock:
    """``base`` plus an offset; frozen, it returns one instant until moved or thawed."""

    def __init__(self, base: Callable[[], float] = time.time) -> None:
        self._base = base
        self._offset = 0.0
        self._frozen_at: float | None = None

    def __call__(self) -> float:
        if self._frozen_at is not None:
            return self._frozen_at
        return self._base() + self._offset

    def advance(self, seconds: float) -> None:
        """Move the time forward (or back, with a negative ``seconds``)."""
        if self._frozen_at is not None:
            self._frozen_at += seconds
        else:
            self._offset += seconds

    def freeze(self, frozen: bool) -> None:
        """Hold the time still at its current reading, or let it run on from there."""
        if frozen and self._frozen_at is None:
            self._frozen_at = self()
        elif not frozen and self._frozen_at is not None:
            self._offset = self._frozen_at - self._base()
            self._frozen_at = None

    def state(self) -> ClockState:
        now = self()
        return ClockState(now=now, offset_s=now - self._base(), frozen=self._frozen_at is not None)
