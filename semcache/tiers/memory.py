"""L1: an in-process LRU store bounded in bytes.

Values are any Python objects; ``sizeof`` tells their size (``len`` by default, for bytes).
The exact cache keeps already verified, decoded entries here, so an L1 hit costs neither a
decode nor a checksum: checks happen where bytes cross a boundary (disk, network).
All operations are synchronous inside the coroutine (no awaits), so they are atomic on the
event loop without a lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final, Self, TypeVar, cast

from semcache.tiers.base import Store

V = TypeVar("V")

_KEY_OVERHEAD: Final = 64  # dict slot, key object and the item tuple, roughly


class _Backend:
    """The LRU shared by a store and its namespace views."""

    def __init__(
        self, max_bytes: int, sizeof: Callable[[Any], int], clock: Callable[[], float]
    ) -> None:
        self.max_bytes = max_bytes
        self.sizeof = sizeof
        self.clock = clock
        # key → (value, expires_at or inf, size)
        self.items: OrderedDict[str, tuple[Any, float, int]] = OrderedDict()
        self.bytes_used = 0
        self.evictions = 0

    def drop(self, key: str) -> None:
        item = self.items.pop(key, None)
        if item is not None:
            self.bytes_used -= item[2]


class MemoryStore(Store[V]):
    """LRU store holding at most ``max_bytes`` (values by ``sizeof`` plus key overhead)."""

    tier = "memory"

    def __init__(
        self,
        max_bytes: int,
        *,
        sizeof: Callable[[V], int] = len,  # type: ignore[assignment]
        namespace: str = "",
        clock: Callable[[], float] = time.monotonic,
        _backend: _Backend | None = None,
    ) -> None:
        super().__init__(namespace)
        self._b = _backend or _Backend(max_bytes, sizeof, clock)

    @property
    def bytes_used(self) -> int:
        return self._b.bytes_used

    @property
    def max_bytes(self) -> int:
        return self._b.max_bytes

    @property
    def evictions(self) -> int:
        return self._b.evictions

    def __len__(self) -> int:
        return len(self._b.items)

    async def get(self, key: str) -> V | None:
        b = self._b
        k = self._full(key)
        item = b.items.get(k)
        if item is None:
            return None
        if item[1] <= b.clock():
            b.drop(k)
            return None
        b.items.move_to_end(k)
        return cast(V, item[0])

    async def set(self, key: str, value: V, ttl_s: float | None = None) -> None:
        b = self._b
        k = self._full(key)
        size = b.sizeof(value) + len(k) + _KEY_OVERHEAD
        b.drop(k)
        if size > b.max_bytes or (ttl_s is not None and ttl_s <= 0):
            return
        expires = b.clock() + ttl_s if ttl_s is not None else float("inf")
        b.items[k] = (value, expires, size)
        b.bytes_used += size
        while b.bytes_used > b.max_bytes:
            _, (_, _, old) = b.items.popitem(last=False)
            b.bytes_used -= old
            b.evictions += 1

    async def delete(self, key: str) -> None:
        self._b.drop(self._full(key))

    async def clear(self) -> None:
        b = self._b
        if not self.namespace:
            b.items.clear()
            b.bytes_used = 0
            return
        prefix = self.namespace + "/"
        for k in [k for k in b.items if k.startswith(prefix)]:
            b.drop(k)

    def with_namespace(self, namespace: str) -> Self:
        return type(self)(self._b.max_bytes, namespace=self._child(namespace), _backend=self._b)
