"""The store protocol every cache tier implements (modelled on Litestar's ``stores``).

A store is an async key/value map with per-value TTL and hierarchical namespaces: a store
``with_namespace("x")`` sees only its own keys, and ``clear()`` on a namespace clears it and
its children. Stores never raise on a backend outage they can survive (see the Redis tier):
an unavailable store answers as a miss and ignores writes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from types import TracebackType
from typing import Generic, Self, TypeVar

V = TypeVar("V")


class Store(ABC, Generic[V]):
    """Async key/value store with TTL and namespaces."""

    tier: str = "store"
    """Short tier name for metrics and results: ``memory``, ``disk``, ``redis``."""

    def __init__(self, namespace: str = "") -> None:
        self.namespace = namespace

    def _full(self, key: str) -> str:
        return f"{self.namespace}/{key}" if self.namespace else key

    @abstractmethod
    async def get(self, key: str) -> V | None:
        """The value, or ``None`` when absent, expired or the store is unavailable."""

    @abstractmethod
    async def set(self, key: str, value: V, ttl_s: float | None = None) -> None:
        """Store ``value``; it disappears after ``ttl_s`` seconds (never when ``None``)."""

    @abstractmethod
    async def delete(self, key: str) -> None:
        """Remove ``key``; absent keys are fine."""

    async def delete_many(self, keys: Iterable[str]) -> None:
        """Remove several keys."""
        for k in keys:
            await self.delete(k)

    @abstractmethod
    async def clear(self) -> None:
        """Remove every key of this namespace and its child namespaces."""

    @abstractmethod
    def with_namespace(self, namespace: str) -> Self:
        """A view of the same backend in the child namespace ``namespace``."""

    def _child(self, namespace: str) -> str:
        return f"{self.namespace}/{namespace}" if self.namespace else namespace

    async def aclose(self) -> None:
        """Release connections or files (views share the backend; close it once)."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
