"""The tests' one fake clock: a clock a test moves by hand (``advance``, or ``now`` set
outright), with a ``sleep`` that ends when the clock passes its end: periodic work of the code
under test runs when the test says time has passed. Tests that never sleep on it use it as a
plain ``Callable[[], float]``."""

from __future__ import annotations

import asyncio


class SteppedClock:
    """Reads ``now`` (seconds); ``advance`` moves it and wakes the sleepers it made due."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def __call__(self) -> float:
        return self.now

    @property
    def sleeping(self) -> int:
        """Sleepers waiting for the clock now."""
        return sum(1 for _, future in self._sleepers if not future.done())

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (self.now + seconds, future)
        self._sleepers.append(entry)
        try:
            await future
        finally:
            self._sleepers.remove(entry)

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for end, future in list(self._sleepers):
            if end <= self.now and not future.done():
                future.set_result(None)
