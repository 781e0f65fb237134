"""Which keys a ``diskcache`` directory may hold, so that a lookup can skip it on a miss.

Nearly every lookup that reaches the disk tier is a miss (a hit was usually served by
memory), and asking SQLite costs a hop to a worker thread and back on the request path.
The filter keeps the process-local ``hash()`` of every key in the directory, read once in
the background and kept current:

* this process adds its own keys before it writes them;
* every writer of the directory (other worker processes included) bumps a generation
  counter, a memory-mapped 8-byte file beside the cache, after its write commits. A filter
  that sees a generation it did not make is not trusted ("maybe present") until it has read
  the rows added since its last read (by ``rowid``) in the background.

So the filter never says "absent" for a key that was committed and announced before the
lookup, with one bounded exception: SQLite may give a new row the rowid of a deleted newest
row, which a catch-up read past that rowid does not see; that key is then a miss in this
process (a backend call, never a wrong answer) until the next full rebuild. Deleted, expired
and evicted keys stay in the set until that rebuild (they only cost a real disk read). A
catch-up read becomes a full rebuild once the set has grown to twice its last full size or
the last full read is ``REBUILD_S`` old.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import diskcache

from semcache.change_counter import Generation

log = logging.getLogger(__name__)

REBUILD_S = 600.0


class KeyFilter:
    """A set of the keys of one ``diskcache.Cache`` that is exact or knows it is not.

    State changes happen on the event loop; the reads of the cache run in worker threads.
    """

    def __init__(self, cache: diskcache.Cache, directory: Path) -> None:
        self._cache = cache
        self.generation = Generation(directory / "keys.gen", directory / "keys.lock")
        self._hashes: set[int] = set()
        self._expected = -1
        """The generation the set is exact for; -1 while not loaded."""
        self._last_rowid = 0
        self._full_size = 0
        self._full_at = 0.0
        self._added_during_scan: list[int] | None = None
        self._sync: asyncio.Task[None] | None = None
        self.skipped = 0
        """Lookups answered "absent" without reading the disk (for tests and stats)."""

    @property
    def ready(self) -> bool:
        return self._expected >= 0

    def __len__(self) -> int:
        return len(self._hashes)

    def may_contain(self, key: str) -> bool:
        """False only when ``key`` is surely not in the cache; starts a refresh if stale."""
        if self._expected >= 0 and self.generation.read() == self._expected:
            if hash(key) in self._hashes:
                return True
            self.skipped += 1
            return False
        self._start_sync()
        return True

    def add(self, key: str) -> None:
        """Note a key this process is about to write."""
        h = hash(key)
        self._hashes.add(h)
        if self._added_during_scan is not None:
            self._added_during_scan.append(h)

    def wrote(self, generation_before_bump: int) -> None:
        """This process committed a write and bumped the generation from the given value."""
        if generation_before_bump == self._expected:
            self._expected = generation_before_bump + 1
        # else: someone else wrote too; the next lookup sees the mismatch and syncs.

    # ------------------------------------------------------------------ background reads

    def _start_sync(self) -> None:
        if self._sync is None or self._sync.done():
            with contextlib.suppress(RuntimeError):  # no running loop: stay untrusted
                self._sync = asyncio.get_running_loop().create_task(self._run_sync())

    async def _run_sync(self) -> None:
        full = (
            not self.ready
            or len(self._hashes) > 2 * self._full_size + 10_000
            or time.monotonic() - self._full_at > REBUILD_S
        )
        if full:
            self._added_during_scan = []
        try:
            gen, rows = await asyncio.to_thread(self._read, 0 if full else self._last_rowid)
        except Exception as exc:  # e.g. diskcache.Timeout or a closed cache: stay untrusted
            log.debug("disk key filter not refreshed: %s", exc)
            self._added_during_scan = None
            return
        hashes = {hash(k) for _, k in rows}
        if full:
            hashes.update(self._added_during_scan or ())
            self._added_during_scan = None
            self._hashes = hashes
            self._full_size = len(hashes)
            self._full_at = time.monotonic()
        else:
            self._hashes |= hashes
        if full or rows:
            self._last_rowid = rows[-1][0] if rows else 0  # rows come in rowid order
        self._expected = gen

    def _read(self, after_rowid: int) -> tuple[int, list[tuple[int, Any]]]:
        """(generation read before the rows, the (rowid, key) rows after ``after_rowid``)."""
        gen = self.generation.read()
        # diskcache has no public scan by rowid; its Cache table and _sql are stable.
        cursor = self._cache._sql(
            "SELECT rowid, key FROM Cache WHERE rowid > ? ORDER BY rowid", (after_rowid,)
        )
        return gen, list(cursor)

    async def wait_ready(self) -> None:
        """Bring the set up to the current generation now (tests; the gateway lets lookups
        start the reads). A read already running may predate the last write: read again."""
        for _ in range(10):  # bounded: a failing read leaves the filter untrusted, not hung
            if self._expected == self.generation.read():
                return
            self._start_sync()
            if self._sync is not None:
                await asyncio.shield(self._sync)

    async def aclose(self) -> None:
        if self._sync is not None:
            self._sync.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._sync
        self.generation.close()
