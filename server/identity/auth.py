"""API tokens: ``Authorization: Bearer <token>`` → the principal that sent the request.

One authentication for every route (``server.envelope.middleware`` applies it): the OpenAI
routes, the Workers-AI routes, batch polling and the admin API. Tokens come from the
gateway config (``[[auth.tokens]]``), in clear (``token``, handy on a laptop), as a SHA-256
hex digest (``token_sha256``, for config files that are shared) or from an environment
variable (``token_env``, a container's Secret; read once at load). Lookups hash the
presented token and compare digests, so the time taken does not depend on how much of a
token matched; tokens are never logged, only the entry's ``name``.

Example::

    [[auth.tokens]]
    token = "TOKEN"
    tenant = "default"
    roles = ["admin"]

    [[auth.tokens]]
    name = "acme-prod"
    token_sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    tenant = "acme"
    accounts = ["acme-prod"]
    limits = { requests_per_minute = 600 }

A token is one tenant on every route: the same cache scope, batches, files, semantic
partitions and vLLM ``cache_salt``. The ``admin`` role may purge, reload the policy, read
every tenant's usage and the request log; the admin token (``[auth.admin]``,
``server.identity.admin_token``) is an admin principal of tenant ``admin``.

With no token configured (the embedded default) the gateway is open: any bearer token is
accepted and the tenant is a hash of it (``key:<hash>``), so each key only sees its own
batches and cache entries; an OpenAI request without a key is tenant ``anonymous``, a
Workers-AI request without one is a 401. ``semcache serve`` refuses to open a gateway on a
non-loopback address unless the config says ``[auth] open = true``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

import msgspec

from backends.registry import ModelInfo
from server.errors import ApiError
from server.identity.admin_token import AdminSettings
from server.identity.api_keys.hashing import looks_like_key
from server.identity.api_keys.records import ApiKey, Role, key_token_id
from server.identity.api_keys.view import KeyView
from server.limits.key_budgets import split_budgets
from server.limits.settings import LimitSettings

ANONYMOUS = "anonymous"
OPEN_PRINCIPALS_KEPT = 10_000
"""An open gateway remembers this many tokens' principals, then starts over."""
"""The tenant of an OpenAI request without a key, on an open gateway."""


class TokenEntry(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tenant: str
    token: str | None = None
    token_sha256: str | None = None
    token_env: str | None = None
    """The token is this environment variable's value, read at load (a container's Secret)."""
    name: str | None = None
    """How logs and limits name this token (default: the first 12 hex digits of its digest)."""
    roles: list[Role] = msgspec.field(default_factory=list)
    accounts: list[str] = msgspec.field(default_factory=list)
    """Account ids this token may use in ``/client/v4/accounts/{id}/...``; empty: any."""
    limits: LimitSettings | None = None
    """Overrides of the ``[limits]`` defaults for this token."""

    def __post_init__(self) -> None:
        given = [self.token, self.token_sha256, self.token_env]
        if sum(value is not None for value in given) != 1:
            raise ValueError(
                "a token entry needs exactly one of `token`, `token_sha256` and `token_env`"
            )
        if self.token is not None and not self.token.strip():
            raise ValueError("`token` must not be empty")
        if self.token_env is not None and not os.environ.get(self.token_env, "").strip():
            raise ValueError(f"`token_env`: the environment variable {self.token_env} is not set")
        if self.token_sha256 is not None:
            digest = self.token_sha256.lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError("`token_sha256` must be 64 hex digits")
        if not self.tenant.strip():
            raise ValueError("`tenant` must not be empty")

    def digest(self) -> str:
        if self.token_sha256 is not None:
            return self.token_sha256.lower()
        if self.token_env is not None:
            return token_digest(os.environ[self.token_env].strip())
        assert self.token is not None
        return token_digest(self.token)


class AuthSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The ``[auth]`` section of the gateway config."""

    tokens: list[TokenEntry] = msgspec.field(default_factory=list)
    """Empty: the gateway is open (see the module doc)."""
    open: bool = False
    """Allow an open gateway (no tokens) on a non-loopback address."""
    admin: AdminSettings | None = None
    """``[auth.admin]``: the admin token (``server.identity.admin_token``); unset: the
    policy's ``[admin]`` table if it has one, else ``$SEMCACHE_ADMIN_TOKEN``."""

    def __post_init__(self) -> None:
        digests = [t.digest() for t in self.tokens]
        for i, d in enumerate(digests):
            if d in digests[:i]:
                raise ValueError(f"tokens[{i}]: the same token is configured twice")
        names = [t.name for t in self.tokens if t.name is not None]
        if len(names) != len(set(names)):
            raise ValueError("two tokens have the same `name`")


class Principal(msgspec.Struct, frozen=True, kw_only=True):
    """Who sent a request: a tenant, the token that names it, and its roles."""

    tenant: str
    token_id: str
    """The token's ``name`` (open gateway: the tenant): what logs and limits use."""
    roles: frozenset[str] = frozenset()
    limits: LimitSettings | None = None
    models: frozenset[str] | None = None
    """The models (ids or aliases) an API key is scoped to; ``None``: every model."""
    budgets: LimitSettings | None = None
    """An API key's own budgets, spent by it alone (its tenant's stay in force too)."""

    @property
    def admin(self) -> bool:
        return "admin" in self.roles


def model_allowed(allowed: frozenset[str] | None, name: str, info: ModelInfo | None) -> bool:
    """Whether a key scoped to ``allowed`` (``None``: every model) may use model ``name``
    (resolved to ``info``: its id and aliases count too)."""
    if allowed is None or name in allowed:
        return True
    return info is not None and (info.id in allowed or not allowed.isdisjoint(info.aliases))


def check_model(allowed: frozenset[str] | None, name: str, info: ModelInfo | None) -> None:
    """A 403 naming the model when a key scoped to ``allowed`` may not use it."""
    if not model_allowed(allowed, name, info):
        raise ApiError(
            403,
            f"This API key may not use the model `{name}`.",
            param="model",
            code="model_not_allowed",
        )


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer_token(headers: Mapping[str, str]) -> str | None:
    """The token of ``Authorization: Bearer <token>``; ``None`` without one (no header,
    another scheme, or an empty token). The gateway's one reading of that header."""
    value = (headers.get("authorization") or "").strip()
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def tenant_from(headers: Mapping[str, str]) -> str:
    """An open gateway's tenant: a hash of the request's API key (never the key itself).

    The key is the bearer token, or the whole ``Authorization`` value when it names no
    ``Bearer`` scheme; without a key the tenant is ``anonymous``.
    """
    raw = headers.get("authorization") or ""
    token = (bearer_token(headers) or "") if raw[:7].lower() == "bearer " else raw.strip()
    if not token:
        return ANONYMOUS
    return "key:" + hashlib.blake2b(token.encode(), digest_size=8).hexdigest()


def _unauthorized(message: str, code: str = "invalid_api_key") -> ApiError:
    return ApiError(
        401,
        message,
        code=code,
        type="invalid_request_error",
        headers={"www-authenticate": "Bearer"},
    )


class TokenAuth:
    """Resolves bearer tokens to principals (built once from the settings and the admin
    token)."""

    def __init__(
        self,
        settings: AuthSettings,
        admin_token: Callable[[], str | None] | None = None,
        keys: KeyView | None = None,
    ) -> None:
        self.keys = keys
        """API keys made through the admin API (``server/identity/api_keys``); ``None``: none."""
        self._key_principals: dict[str, tuple[ApiKey, Principal]] = {}
        self._open_principals: dict[str, Principal] = {}
        """An open gateway's principals by ``Authorization`` value (no secret to keep: any
        token is accepted), so a repeat costs no hash."""
        self._by_digest: dict[str, tuple[Principal, TokenEntry]] = {}
        for entry in settings.tokens:
            digest = entry.digest()
            principal = Principal(
                tenant=entry.tenant,
                token_id=entry.name or digest[:12],
                roles=frozenset(entry.roles),
                limits=entry.limits,
            )
            self._by_digest[digest] = (principal, entry)
        self._by_token: dict[str, tuple[Principal, TokenEntry]] = {}
        """The configured tokens met so far, by their text (no more than are configured), so a
        repeat costs no hash."""
        self._admin_token = admin_token

    @property
    def config_token_ids(self) -> list[str]:
        """How the config's tokens are named (what the key API refuses to change)."""
        return [principal.token_id for principal, _ in self._by_digest.values()]

    @property
    def principals(self) -> list[Principal]:
        """The principal of every configured token (none on an open gateway)."""
        return [principal for principal, _ in self._by_digest.values()]

    @property
    def admin_token(self) -> str | None:
        """The admin token now (a policy reload may change one the policy gives)."""
        return self._admin_token() if self._admin_token is not None else None

    @property
    def open(self) -> bool:
        """No token configured: any bearer token is accepted, scoped by its hash."""
        return not self._by_digest

    def authenticate(
        self,
        headers: Mapping[str, str],
        account_id: str | None = None,
        *,
        key_required: bool = False,
    ) -> Principal:
        """The principal of a request; ApiError 401 without a valid token.

        ``key_required``: an open gateway still wants some bearer token (Workers-AI routes).
        """
        token = bearer_token(headers)
        admin = self.admin_token
        if token is not None and admin is not None:
            if hmac.compare_digest(token.encode(), admin.encode()):
                return Principal(tenant="admin", token_id="admin", roles=frozenset({"admin"}))
        if token is not None and self.keys is not None and looks_like_key(token):
            if not self._by_digest or self._configured(token) is None:
                return self._key_principal(self.keys, token)
        if self.open:
            if token is None and key_required:
                raise _unauthorized("Send `Authorization: Bearer <API token>`.")
            raw = headers.get("authorization") or ""
            principal = self._open_principals.get(raw)
            if principal is None:
                if len(self._open_principals) >= OPEN_PRINCIPALS_KEPT:
                    self._open_principals.clear()
                tenant = tenant_from(headers)
                principal = self._open_principals[raw] = Principal(tenant=tenant, token_id=tenant)
            return principal
        if token is None:
            raise _unauthorized(
                "You didn't provide an API key: send `Authorization: Bearer <API token>`."
            )
        found = self._configured(token)
        if found is None:
            raise _unauthorized("Incorrect API key provided.")
        principal, entry = found
        if account_id is not None and entry.accounts and account_id not in entry.accounts:
            raise ApiError(
                403,
                f"This API token may not use account `{account_id}`.",
                code="account_not_allowed",
            )
        return principal

    def _configured(self, token: str) -> tuple[Principal, TokenEntry] | None:
        """The configured token ``token`` is, with its principal; ``None``: none."""
        found = self._by_token.get(token)
        if found is None:
            found = self._by_digest.get(token_digest(token))
            if found is not None:
                self._by_token[token] = found
        return found

    def _key_principal(self, keys: KeyView, token: str) -> Principal:
        found = keys.lookup(token)
        if found is None:
            raise _unauthorized("Incorrect API key provided.")
        key = found.key
        if found.refused == "revoked":
            raise _unauthorized(f"The API key `{key.id}` has been revoked.", "api_key_revoked")
        if found.refused == "expired":
            assert key.expires_at is not None
            raise _unauthorized(
                f"The API key `{key.id}` expired at {_iso(key.expires_at)}.", "api_key_expired"
            )
        if found.refused == "rotated":
            raise _unauthorized(
                f"This secret of the API key `{key.id}` was rotated and its grace period "
                "has ended: use the new secret.",
                "api_key_rotated",
            )
        cached = self._key_principals.get(key.id)
        if cached is not None and cached[0] is key:
            return cached[1]
        limits, budgets = split_budgets(key.limits)
        principal = Principal(
            tenant=key.tenant,
            token_id=key_token_id(key.id),
            roles=frozenset(key.roles),
            limits=limits,
            budgets=budgets,
            models=None if key.models is None else frozenset(key.models),
        )
        self._key_principals[key.id] = (key, principal)
        return principal


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_problem(settings: AuthSettings, host: str) -> str | None:
    """Why a gateway with these settings must not listen on ``host``; ``None`` if it may."""
    if settings.tokens or settings.open or is_loopback(host):
        return None
    return (
        f"no API tokens are configured and {host} is not a loopback address: anyone who "
        "reaches it could use the gateway. Add [[auth.tokens]] to the config, or set "
        "[auth] open = true to serve an open gateway on purpose."
    )


def describe(settings: AuthSettings) -> str:
    """The start-up line's word on authentication."""
    if not settings.tokens:
        return "OPEN (no API tokens: each bearer key is a tenant of its own)"
    admins = sum(1 for t in settings.tokens if "admin" in t.roles)
    tenants = len({t.tenant for t in settings.tokens})
    return f"{len(settings.tokens)} API tokens, {tenants} tenants, {admins} with the admin role"
