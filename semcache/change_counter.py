"""A cross-process change counter: a memory-mapped 8-byte file and the file lock guarding it.

Processes of one machine that share a directory (the purge epochs, the disk tier's keys)
bump it after each change they commit; a reader compares it with the value it last saw, for
the price of a memory read, to know whether another process changed something.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from collections.abc import Iterator
from pathlib import Path


class Generation:
    """The counter in ``path``, its read-modify-writes serialised by a lock on ``lock_path``."""

    def __init__(self, path: Path, lock_path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_path = lock_path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size < 8:
                os.ftruncate(fd, 8)
            self._map = mmap.mmap(fd, 8)
        finally:
            os.close(fd)

    def read(self) -> int:
        return int.from_bytes(self._map[:8], "little")

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the lock (blocking) for a change and its :meth:`increment`."""
        with open(self._lock_path, "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def increment(self) -> int:
        """Add one, the lock being held by the caller; returns the value before."""
        before = self.read()
        self._map[:8] = (before + 1).to_bytes(8, "little")
        return before

    def bump(self) -> int:
        """Take the lock and add one (blocking); returns the value before."""
        with self.locked():
            return self.increment()

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
