"""An API surface as the shared layers know it: one object per surface package.

Each surface package (``server/openai``, ``server/anthropic``, ``server/workers_ai``,
``server/gateway_api``, ``server/admin``, ``server/dashboard``, ``server/health``) exports
one ``Surface`` from its ``surface.py``: its routes, the path prefixes it owns, its error
format, where its clients may put their key besides ``Authorization: Bearer``, the routes
whose byte-identical repeats the early hits answer, its answer while the gateway drains, and
the serving objects its routes read from the app state. The app factory registers a list of
them (``server/surfaces.py``); the exception handler, draining, the OpenAPI document and the
envelope read ``Surfaces`` and name no surface's path.
"""

from __future__ import annotations

import asyncio
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Mapping,
    Sequence,
)
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

from backends.registry import Task
from semcache.entry import CachedAnswer
from semcache.exact import CacheRequest, CacheResult
from server.errors import OPENAI_ERRORS, ApiError, ErrorFormat
from server.http.reply import Reply

if TYPE_CHECKING:
    from litestar.template import TemplateConfig
    from litestar.types import ControllerRouterHandler

    from server.batch.system import BatchSystem
    from server.config import GatewayConfig
    from server.metrics import GatewayMetrics
    from server.serving.core import ServingCore
    from server.serving.generation import Generation
    from server.serving.pooling import Pooling
    from server.serving.tokenization import Tokenization

Render = Callable[[CachedAnswer, CacheResult, CacheRequest, bool], Reply]
"""A surface's reply to an early hit: (the stored answer, how the cache answered, the request
it was keyed by, whether a stream was asked for) → the Reply its route sends, cache headers
included."""


@dataclass(frozen=True, slots=True)
class Watched:
    """A route the early hits answer: the cache's route name, the task its model serves, and,
    for a surface that answers in its own shape, how its route renders a hit."""

    route: str
    task: Task
    render: Render | None = None
    """``None``: the stored answer replayed as OpenAI's (``semcache.replay``)."""


@dataclass(frozen=True)
class Services:
    """What the app factory built that a surface's serving objects are made of."""

    config: GatewayConfig
    core: ServingCore
    generation: Generation
    pooling: Pooling
    tokens: Tokenization
    batch_system: BatchSystem
    metrics: GatewayMetrics


Lifespan = Callable[[Mapping[str, Any]], AbstractAsyncContextManager[None]]
"""What runs while the app serves, given the app state (a surface's background tasks)."""


@asynccontextmanager
async def running(work: Coroutine[Any, Any, None], name: str) -> AsyncIterator[None]:
    """``work`` as a task while the block runs; cancelled and awaited when it ends."""
    task = asyncio.create_task(work, name=name)
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@dataclass(frozen=True)
class Surface:
    """One API surface (see the module doc)."""

    name: str
    prefixes: tuple[str, ...]
    """The paths it owns, each with what lies under it (``/v1`` owns ``/v1/models``, not
    ``/v1beta``); the longest prefix that matches a path names its surface."""
    routes: Sequence[ControllerRouterHandler] = ()
    errors: ErrorFormat = OPENAI_ERRORS
    key_headers: tuple[str, ...] = ()
    """Request headers that carry the API key as ``Authorization: Bearer`` would (lower
    case): on this surface's paths only, and only when no ``Authorization`` came."""
    key_query: tuple[str, ...] = ()
    """Query parameters that do the same, after the headers."""
    early_hits: Mapping[str, Watched] = field(default_factory=dict)
    """Paths whose repeats are answered before routing (``server/envelope/early_hits.py``)."""
    open_while_draining: frozenset[str] = frozenset()
    """Paths answered as usual while the gateway drains (``server/http/draining.py``)."""
    refusal: Callable[[ApiError], bytes] | None = None
    """The body of a request refused while draining; ``None``: its error format's."""
    build: Callable[[Services], Mapping[str, Any]] | None = None
    """The app state entries its routes read (its serving objects), made at app build."""
    lifespan: Lifespan | None = None
    close: Callable[[Mapping[str, Any]], Awaitable[None]] | None = None
    """What closes what its build opened (stores), once the batch workers have stopped."""
    templates: TemplateConfig | None = None
    """The templates its pages render (the app has one template config)."""

    def owns(self, path: str) -> int:
        """The length of the longest prefix of ``path`` this surface owns; 0: none."""
        best = 0
        for prefix in self.prefixes:
            if len(prefix) > best and (
                path == prefix or path.startswith(prefix if prefix.endswith("/") else prefix + "/")
            ):
                best = len(prefix)
        return best


STANDARD_HEADERS = ("authorization", "x-request-id")
"""What the envelope reads of every request: the bearer token and the client's request id."""


class Surfaces:
    """The registered surfaces, and what each shared layer asks of them."""

    def __init__(self, surfaces: Iterable[Surface]) -> None:
        self.all = tuple(surfaces)
        names = [s.name for s in self.all]
        if len(set(names)) != len(names):
            raise ValueError(f"two surfaces share a name: {names}")
        self._by_path: dict[str, Surface | None] = {}
        headers = {*STANDARD_HEADERS, *(h for s in self.all for h in s.key_headers)}
        self.wanted_headers = frozenset(h.encode() for h in headers)
        """The request headers the envelope reads (every surface's key headers included)."""
        self._wanted_lengths = frozenset(len(h) for h in self.wanted_headers)
        self.early_hits: dict[str, Watched] = {}
        for surface in self.all:
            for path, watched in surface.early_hits.items():
                if path in self.early_hits:
                    raise ValueError(f"two surfaces answer early hits on {path}")
                self.early_hits[path] = watched

    def of(self, path: str) -> Surface | None:
        """The surface that owns ``path`` (a request's path or a route's template)."""
        try:
            return self._by_path[path]
        except KeyError:
            pass
        best: Surface | None = None
        length = 0
        for surface in self.all:
            owned = surface.owns(path)
            if owned > length:
                best, length = surface, owned
        if len(self._by_path) < 4096:  # route templates and watched paths; bounded all the same
            self._by_path[path] = best
        return best

    def routes(self) -> list[ControllerRouterHandler]:
        return [route for surface in self.all for route in surface.routes]

    def errors_of(self, path: str) -> ErrorFormat:
        """The error format of ``path``: its surface's, or the gateway's own."""
        surface = self.of(path)
        return surface.errors if surface is not None else OPENAI_ERRORS

    def open_while_draining(self, path: str) -> bool:
        surface = self.of(path)
        return surface is not None and path in surface.open_while_draining

    def refusal(self, path: str, err: ApiError) -> bytes:
        """The body of ``err`` refusing a request to ``path`` while the gateway drains."""
        surface = self.of(path)
        if surface is not None and surface.refusal is not None:
            return surface.refusal(err)
        return self.errors_of(path).render(err)[1]

    def read_headers(self, raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
        """The headers the envelope reads, from the ASGI scope's raw list."""
        out: dict[str, str] = {}
        lengths, wanted = self._wanted_lengths, self.wanted_headers
        for name, value in raw:
            if len(name) in lengths and (low := name.lower()) in wanted:
                out[low.decode()] = value.decode("latin-1")
        return out

    def with_bearer(
        self, route: str, headers: dict[str, str], query: bytes = b""
    ) -> dict[str, str]:
        """``headers`` with the key a client of ``route``'s surface sent in its own header
        or query parameter read as the bearer token, when no ``Authorization`` came."""
        if "authorization" in headers:
            return headers
        surface = self.of(route)
        if surface is None:
            return headers
        for name in surface.key_headers:
            if key := headers.get(name, "").strip():
                return {**headers, "authorization": f"Bearer {key}"}
        if surface.key_query and query:
            params = dict(parse_qsl(query.decode("latin-1")))
            for name in surface.key_query:
                if key := params.get(name, "").strip():
                    return {**headers, "authorization": f"Bearer {key}"}
        return headers
