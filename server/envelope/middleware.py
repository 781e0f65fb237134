"""The one place every API request is authenticated, admitted and accounted for.

Before the route runs: the bearer token → a ``Principal`` (401/403 in the route's own error
format otherwise), once per request, then the limits. While the answer goes out: its
status, the time to its first body byte, whether it was sent whole. After: the
``semcache_requests`` metric, the request log, the usage ledger and the limits'
reconciliation, from the ``RequestRecord`` the serving path filled in (``record.usage`` is
the request context's ``usage``). ``Envelope.run`` is that path, for a routed request
(``EnvelopeMiddleware``) and for an exact hit answered before routing (``early_hits``) alike;
the middleware also counts the requests in flight and refuses new ones while draining.

A route says what it needs in its ``opt``: ``auth="public"`` (health, metrics: no token),
``auth="self"`` (the dashboard: it authenticates with the same ``TokenAuth`` itself, after
its router has read the login cookie),
``auth="key"`` (an open gateway still wants some bearer token: the Workers-AI routes),
``auth="admin"`` (the admin role); anything else needs a token when tokens are configured.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from litestar.types import ASGIApp, Message, Receive, ReceiveMessage, Scope, Send

from foundation import tracing as spans
from foundation.request import RequestContext, RequestUsage
from foundation.tracing import Tracing
from semcache.ledger import UsageLedger
from semcache.policy import PolicyHolder
from server.envelope.bodies import BodyCapture
from server.envelope.ledger_record import BATCH_ROUTE, ledger_record
from server.envelope.record import RECORD_KEY, RequestRecord, item_line, log_line
from server.envelope.request_log import RequestLog
from server.envelope.server_span import run_traced
from server.errors import ERROR_CODE_KEY, ApiError
from server.http.draining import REFUSAL, Drain, refuse
from server.identity.auth import ANONYMOUS, TokenAuth
from server.limits.limiter import LimitAdmission, TenantLimiter, estimate_tokens
from server.metrics import GatewayMetrics
from server.surface import Surfaces

if TYPE_CHECKING:
    from litestar.handlers import HTTPRouteHandler


class RequestIds:
    """Request ids unique across gateways and restarts: a random prefix per process, then
    a counter (cheaper than a UUID per request: no system call)."""

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(8)
        self._count = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._count):016x}"


@dataclass
class Envelope:
    """What every request goes through; built by the app factory."""

    auth: TokenAuth
    metrics: GatewayMetrics
    policy: PolicyHolder
    drain: Drain = field(default_factory=Drain)
    request_log: RequestLog | None = None
    limiter: TenantLimiter | None = None
    max_body_bytes: int = 10 * 1024 * 1024
    """Bodies read ahead to estimate their tokens stop here (the route answers 413)."""
    ledger: UsageLedger | None = None
    tracing: Tracing | None = None
    """Each request's trace (``server/envelope/server_span.py``); ``None``: tracing is off."""
    clock: Callable[[], float] = time.time
    surfaces: Surfaces = field(default_factory=lambda: Surfaces(()))
    """The registered surfaces: where a request's key may come (``Surface.key_headers``), how
    a request is refused while draining."""
    _routes: dict[int, tuple[str, str]] = field(default_factory=dict)
    _ids: RequestIds = field(default_factory=lambda: RequestIds())

    def route_of(self, handler: HTTPRouteHandler) -> tuple[str, str]:
        """``(path template, auth need)`` of a route handler, read once per handler."""
        found = self._routes.get(id(handler))
        if found is None:
            found = (min(handler.paths), str(handler.opt.get("auth", "token")))
            self._routes[id(handler)] = found
        return found

    def begin(self, scope: Scope) -> RequestRecord | None:
        """The record of the request of ``scope``, authenticated; ``None`` for a public route.

        A request the early hits already authenticated (a record in the scope, for this
        route and a token's need) is not authenticated again."""
        route, need = self.route_of(scope["route_handler"])  # type: ignore[arg-type]
        if need in ("public", "self"):
            return None
        opened = scope["state"].get(RECORD_KEY)
        if opened is not None and opened.route == route and need == "token":
            return opened
        account = scope["path_params"].get("account_id")
        headers = self.surfaces.read_headers(scope["headers"])
        return self.open_record(route, need, headers, account, scope.get("query_string", b""))

    def open_record(
        self,
        route: str,
        need: str,
        headers: dict[str, str],
        account_id: str | None,
        query: bytes = b"",
    ) -> RequestRecord:
        """The record of a request to ``route`` (an ApiError 401/403 when its token does not
        meet ``need``); ``headers``: what ``Surfaces.read_headers`` read; ``query``: the raw
        query string (a surface may take the key there)."""
        credentials = self.surfaces.with_bearer(route, headers, query)
        principal = self.auth.authenticate(
            credentials, account_id, key_required=need in ("key", "admin")
        )
        if need == "admin" and not principal.admin:
            if self.auth.open and self.auth.admin_token is None:
                raise ApiError(403, "The admin API is disabled: no admin token is configured.")
            raise ApiError(403, "This route needs a token with the admin role.")
        return RequestRecord(
            request_id=headers.get("x-request-id") or self._ids.next(),
            time=self.clock(),
            started=time.perf_counter(),
            principal=principal,
            route=route,
            trace_id=spans.current_trace_id(),
        )

    def body_capture(self) -> BodyCapture | None:
        """A capture of the next request's bodies, when some rule may want them logged."""
        if self.request_log is None or not self.policy.current.logs_bodies:
            return None
        return BodyCapture(self.request_log.settings.max_body_bytes)

    def logs_bodies_of(self, record: RequestRecord) -> bool:
        """Whether the rule of the request's model and route says ``log_bodies``."""
        usage = record.usage
        if usage.model is None or usage.route is None:
            return False
        return self.policy.current.rule(usage.model, usage.route).log_bodies

    def finish(self, record: RequestRecord) -> None:
        """Account for a request that has ended, however it ended."""
        model = record.usage.model or "-"
        labels = (record.route, model, str(record.status))
        if self.request_log is not None and self.request_log.settings.tenant_metrics:
            self.metrics.tenant_requests.labels(record.principal.tenant, *labels).inc()
        else:
            self.metrics.requests.labels(*labels).inc()
        self.metrics.cache_outcomes.labels(record.route, model, record.usage.cache.value).inc()
        if self.request_log is not None:
            self.request_log.write(log_line(record))
        self._count_usage(
            record.principal.tenant, record.route, record.usage, record.status, record.time
        )

    async def admit(
        self, record: RequestRecord, receive: Receive, estimate: int | None = None
    ) -> tuple[LimitAdmission | None, Receive]:
        """Count the request against its token's limits (ApiError 429 when over); the
        ``receive`` to run the route with (the body was read ahead to estimate its tokens,
        unless the caller knows the ``estimate`` of its body). ``None``: no limit or budget
        applies to its token, nothing to count or settle."""
        assert self.limiter is not None
        principal = record.principal
        own = principal.budgets
        settings = self.limiter.settings_of(principal.limits)
        if not settings.limited and (own is None or not own.limited):
            return None, receive
        if not settings.estimates_tokens and (own is None or not own.estimates_tokens):
            estimate = 0
        elif estimate is None:
            body, receive = await read_ahead(receive, self.max_body_bytes)
            estimate = estimate_tokens(body)
        with spans.span("limits"):
            admission = await self.limiter.admit(
                principal.token_id,
                principal.tenant,
                principal.limits,
                estimate,
                background=record.background,
                own_budgets=own,
            )
        return admission, receive

    async def settle(self, record: RequestRecord, admission: LimitAdmission) -> None:
        """Correct the token estimate with what the request used; free its slot."""
        assert self.limiter is not None
        usage = record.usage
        hit = usage.cache.hit
        prompt, completion = usage.prompt_tokens, usage.completion_tokens
        if admission.settings.hits_spend_tokens:  # a hit's and a partial answer's cached part
            prompt += usage.saved_prompt_tokens
            completion += usage.saved_completion_tokens
        cost = 0.0
        if admission.key_charge is not None and admission.key_charge.usd_keys and usage.model:
            prices = self.policy.current.rule(usage.model, usage.route or "").prices
            cost = prices.cost_usd(
                usage.prompt_tokens, usage.completion_tokens, usage.prefix_cached_tokens
            )
        await self.limiter.settle(admission, prompt, completion, cache_hit=hit, cost_usd=cost)

    async def run(
        self,
        record: RequestRecord,
        admission: LimitAdmission | None,
        scope: Scope,
        receive: Receive,
        send: Send,
        app: ASGIApp,
        capture: BodyCapture | None = None,
    ) -> None:
        """Run ``app`` (the route, or an early hit's answer) for an authenticated and admitted
        request, accounting for what it sends: its status and rate-limit headers, the time to
        the first body byte, whether the answer was whole; then finish and settle it.
        ``capture``: the bodies to keep for the request log (``body_capture``)."""
        scope["state"][RECORD_KEY] = record
        limiter = self.limiter
        extra = (
            limiter.encoded_headers(admission)
            if limiter is not None and admission is not None
            else []
        )
        if capture is not None:
            receive = capture.receiving(receive)

        async def accounted(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                if extra:
                    message["headers"] = [*message.get("headers", ()), *extra]
                if capture is not None:
                    capture.wanted = self.logs_bodies_of(record)
            elif message["type"] == "http.response.body":
                if record.ttft_s is None and message.get("body"):
                    record.ttft_s = time.perf_counter() - record.started
                if capture is not None:
                    capture.sent(message.get("body", b""))
                if not message.get("more_body", False):
                    record.completed = True
            await send(message)

        try:
            await app(scope, receive, accounted)
        finally:
            record.latency_s = time.perf_counter() - record.started
            record.usage.error_code = scope["state"].get(ERROR_CODE_KEY)
            if capture is not None and capture.wanted and not record.usage.inspected:
                record.bodies = capture.fields()  # never the bodies the content rules read
            self.finish(record)
            if admission is not None:
                await self.settle(record, admission)

    def finish_item(self, ctx: RequestContext, success: bool) -> None:
        """Account for a batch item this gateway finished (it never passed the middleware)."""
        now = self.clock()
        line = item_line(ctx, success, now)
        if self.request_log is not None:
            self.request_log.write(line)
        status = 200 if success else 500
        self._count_usage(ctx.tenant or ANONYMOUS, BATCH_ROUTE, ctx.usage, status, now)
        # limits: nothing more to count: the ledger's record spends the tenant's budgets, and
        # a batch item takes no capacity of the live windows (server/limits/limiter.py).

    def _count_usage(
        self, tenant: str, route: str, usage: RequestUsage, status: int, now: float
    ) -> None:
        """Add a request's usage to the ledger, priced at the current policy's prices."""
        if self.ledger is None:
            return
        found = ledger_record(
            tenant=tenant,
            route=route,
            usage=usage,
            status=status,
            now=now,
            policy=self.policy.current,
        )
        if found is not None:
            self.ledger.add(found)


async def read_ahead(receive: Receive, limit: int) -> tuple[bytes, Receive]:
    """The request body (up to ``limit`` bytes and one chunk) and a ``receive`` that hands the
    messages read to the app again, then goes on with the client's."""
    messages: list[ReceiveMessage] = []
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    pending = iter(messages)

    async def replay() -> ReceiveMessage:
        return next(pending, None) or await receive()

    return body, replay


class EnvelopeMiddleware:
    """ASGI middleware applying the ``Envelope`` to every HTTP request (see the module doc)."""

    def __init__(self, app: ASGIApp, envelope: Envelope) -> None:
        self.app = app
        self.envelope = envelope

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        drain = self.envelope.drain
        path = scope["path"]
        surfaces = self.envelope.surfaces
        if drain.draining and not surfaces.open_while_draining(path):
            drain.refused += 1
            await refuse(surfaces.refusal(path, REFUSAL), send)
            return
        drain.enter()  # not `holding()`: a generator's context costs more than the request
        try:
            tracing = self.envelope.tracing
            if tracing is None or spans.current() is not None:  # off, or the early hits'
                await self._serve(scope, receive, send)
                return
            route, need = self.envelope.route_of(scope["route_handler"])  # type: ignore[arg-type]
            if need == "public":  # health checks and scrapes: no trace
                await self._serve(scope, receive, send)
                return
            await run_traced(tracing, scope, route, lambda: self._serve(scope, receive, send))
        finally:
            drain.leave()

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        envelope = self.envelope
        with spans.span("auth"):
            record = envelope.begin(scope)
        if record is None:
            await self.app(scope, receive, send)
            return
        admission: LimitAdmission | None = None
        if envelope.limiter is not None:
            try:
                admission, receive = await envelope.admit(record, receive)
            except ApiError as err:  # answered in the route's format by the exception handler
                record.status = err.status
                record.usage.error_code = err.code
                record.latency_s = time.perf_counter() - record.started
                envelope.finish(record)
                raise
        capture = envelope.body_capture()
        await envelope.run(record, admission, scope, receive, send, self.app, capture)


def envelope_middleware(envelope: Envelope) -> Callable[[ASGIApp], ASGIApp]:
    """The middleware factory Litestar's ``middleware=[...]`` takes."""

    def build(app: ASGIApp) -> ASGIApp:
        return EnvelopeMiddleware(app, envelope)

    return build
