"""What one request carries through every layer: who sent it, where it may queue, what it
used and saved. Plain data: the server fills it in, backends route and queue on it, the
usage ledger and the limits read it once the request has ended; nothing here knows a cache
or HTTP."""

from __future__ import annotations

from enum import StrEnum
from typing import Final, Literal

import msgspec

Band = Literal["interactive", "batch", "background"]
BANDS: tuple[Band, ...] = ("interactive", "batch", "background")
"""Highest priority first."""

ANONYMOUS = "-"


class QueueTicket(msgspec.Struct, frozen=True, kw_only=True):
    """What the queue knows of a request: set by the server from its ``[queue]`` config."""

    tenant: str = ANONYMOUS
    band: Band = "interactive"
    weight: float = 1.0
    max_queued: int | None = None
    """Waiters of this tenant (in this pool) past which a new one is refused."""
    max_wait_s: float | None = None
    """The longest this request waits (the pool's own ``queue_timeout_s`` bounds it too)."""
    share_window_s: float = 0.0
    """How long a flow (a tenant in a band) counts as active after its last request; while
    two or more are active, each holds at most its weighted share of the pool's slots (see
    ``backends.fleet.admission``). 0: no cap, a free slot goes to whoever asks."""


class CacheOutcome(StrEnum):
    """How the cache answered a request: the one value the headers' counterparts, the usage
    ledger, the limits and budgets, ``/metrics``, the request log and the traces all read.

    - ``none``: not consulted (an uncached route or model, or an error before the lookup);
    - ``miss``: the backends answered (the answer may be stored);
    - ``exact`` and ``stale``: the whole answer from the exact cache, fresh or within its
      stale-while-revalidate window (RFC 5861), or another request's answer, coalesced;
    - ``semantic``: the whole answer from near-identical cached requests (every item of a
      pooling request, or a chat match);
    - ``partial``: some items of a pooling request (embeddings, classification, scoring
      pairs) from the cache, the rest computed. **A partial answer is not a hit**: it counts
      in no hit count (the ledger's, the limits', ``/metrics``'), and its cached items are
      counted as saved tokens everywhere: the ledger's ``tokens_saved`` and ``saved_usd``,
      and the limits and budgets, which spend saved tokens only under
      ``hits_spend_tokens``, as they do a hit's;
    - ``bypass``: the client's directives or the policy skipped the lookup.
    """

    NONE = "none"
    MISS = "miss"
    EXACT = "exact"
    STALE = "stale"
    SEMANTIC = "semantic"
    PARTIAL = "partial"
    BYPASS = "bypass"

    @property
    def hit(self) -> bool:
        """The whole answer came from the cache."""
        return self in _HITS

    @property
    def exact(self) -> bool:
        """The whole answer came from the exact cache (fresh or stale)."""
        return self is CacheOutcome.EXACT or self is CacheOutcome.STALE


_HITS: Final = frozenset({CacheOutcome.EXACT, CacheOutcome.STALE, CacheOutcome.SEMANTIC})


class RequestUsage(msgspec.Struct, kw_only=True):
    """What one request used and saved, filled in along its way; read once it has ended
    (by the usage ledger, the limits and the request log)."""

    model: str | None = None
    route: str | None = None
    """The policy's name of the route (``chat``, ``embeddings``, …): with ``model``, it
    names the rule (prices, whether bodies are logged)."""
    cache: CacheOutcome = CacheOutcome.NONE
    prompt_tokens: int = 0
    """Tokens the backends computed for this request (a hit computes none)."""
    prefix_cached_tokens: int = 0
    """Of ``prompt_tokens``, those vLLM found in its prefix cache (the answers'
    ``prompt_tokens_details.cached_tokens``): priced at ``cached_input_per_m``."""
    completion_tokens: int = 0
    saved_prompt_tokens: int = 0
    """Tokens a cached answer spared the backends."""
    saved_completion_tokens: int = 0
    servers: list[str] = msgspec.field(default_factory=list)
    """The backend servers that took part, in order (prefill then decode on a P/D hop)."""
    pd_hop: bool = False
    """A prefill server computed the prompt and handed its KV to the decode server."""
    pd_handoff_s: float | None = None
    """Seconds from the prefill answer to the decode server's first streamed event."""
    error_code: str | None = None
    inspected: bool = False
    """A DLP or guardrail rule applied to the request: its bodies are never logged, and its
    exact hits are not answered before routing (each repeat is inspected again)."""
    findings: list[str] = msgspec.field(default_factory=list)
    """What the inspection found, as ``direction:TYPE:action`` (types, never values)."""

    def add(self, prompt_tokens: int, completion_tokens: int, prefix_cached: int = 0) -> None:
        self.prompt_tokens += max(prompt_tokens, 0)
        self.completion_tokens += max(completion_tokens, 0)
        self.prefix_cached_tokens += max(prefix_cached, 0)

    def saved(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.saved_prompt_tokens += max(prompt_tokens, 0)
        self.saved_completion_tokens += max(completion_tokens, 0)


class RequestContext(msgspec.Struct, kw_only=True):
    """Per-request facts a backend may route on; never cache state."""

    request_id: str
    session_affinity: str | None = None
    tenant: str | None = None
    token_id: str | None = None
    """The API key (``key:<id>``) or config token (its name) that sent the request."""
    salt_scope: str | None = None
    """Who may share vLLM's prefix-cache blocks with this request: the answer cache's scope
    (``tenant:<id>``, ``group:<name>`` or ``shared``, as the policy shares the model's answers);
    backends derive vLLM's ``cache_salt`` from it."""
    background: bool = False
    """A batch item: it runs on idle capacity and never makes batch work yield."""
    models: frozenset[str] | None = None
    """The models (ids or aliases) the request's API key may use; ``None``: every model."""
    usage: RequestUsage = msgspec.field(default_factory=RequestUsage)
    """What the request used and saved, for the ledger, the limits and the request log."""
    queue: QueueTicket | None = None
    """Its place in a full pool's wait queue (band, tenant, weight, bounds); ``None``: first
    come, first served."""
