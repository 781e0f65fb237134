"""API tokens: ``Authorization: Bearer <token>`` → the tenant that owns the request.

Tokens come from the gateway config (``[[auth.tokens]]``), either in clear (``token``, handy on a
laptop) or as a SHA-256 hex digest (``token_sha256``, for config files that are shared).
Lookups hash the presented token and compare digests, so the time taken does not depend
on how much of a token matched. A token may be limited to some Cloudflare-style account ids.

Example::

    [[auth.tokens]]
    token = "TOKEN"
    tenant = "default"

    [[auth.tokens]]
    token_sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    tenant = "acme"
    accounts = ["acme-prod"]

With no token configured (the embedded default) the gateway is open, as on the OpenAI
routes: any bearer token is accepted and the tenant is a hash of it (``key:<hash>``), so
each key only sees its own batches and cache entries. A request without a bearer token is
still a 401.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import msgspec

from server.errors import ApiError


class TokenEntry(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tenant: str
    token: str | None = None
    token_sha256: str | None = None
    accounts: list[str] = msgspec.field(default_factory=list)
    """Account ids this token may use in ``/client/v4/accounts/{id}/...``; empty: any."""

    def __post_init__(self) -> None:
        if (self.token is None) == (self.token_sha256 is None):
            raise ValueError("a token entry needs exactly one of `token` and `token_sha256`")
        if self.token is not None and not self.token.strip():
            raise ValueError("`token` must not be empty")
        if self.token_sha256 is not None:
            digest = self.token_sha256.lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError("`token_sha256` must be 64 hex digits")
        if not self.tenant.strip():
            raise ValueError("`tenant` must not be empty")

    def digest(self) -> str:
        if self.token_sha256 is not None:
            return self.token_sha256.lower()
        assert self.token is not None
        return token_digest(self.token)


class AuthSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The ``[auth]`` section of the gateway config (``/client/v4`` routes)."""

    tokens: list[TokenEntry] = msgspec.field(default_factory=list)
    """Empty: any bearer token is accepted, its tenant is a hash of it (see the module doc)."""

    def __post_init__(self) -> None:
        digests = [t.digest() for t in self.tokens]
        for i, d in enumerate(digests):
            if d in digests[:i]:
                raise ValueError(f"tokens[{i}]: the same token is configured twice")


class Principal(msgspec.Struct, frozen=True, kw_only=True):
    """Who sent a request: the tenant its token belongs to."""

    tenant: str


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
    """The tenant scope of a request: a hash of its API key (never the key itself).

    The key is the bearer token, or the whole ``Authorization`` value when it names no
    ``Bearer`` scheme; without a key the tenant is ``anonymous``.
    """
    raw = headers.get("authorization") or ""
    token = (bearer_token(headers) or "") if raw[:7].lower() == "bearer " else raw.strip()
    if not token:
        return "anonymous"
    return "key:" + hashlib.blake2b(token.encode(), digest_size=8).hexdigest()


class TokenAuth:
    """Resolves bearer tokens to principals (built once from the settings)."""

    def __init__(self, settings: AuthSettings) -> None:
        self._by_digest: dict[str, TokenEntry] = {}
        for entry in settings.tokens:
            self._by_digest[entry.digest()] = entry

    @property
    def open(self) -> bool:
        """No token configured: any bearer token is accepted, scoped by its hash."""
        return not self._by_digest

    def authenticate(self, headers: Mapping[str, str], account_id: str | None = None) -> Principal:
        """The principal of a request; ApiError 401 without a valid token."""
        token = bearer_token(headers)
        if token is None:
            raise ApiError(
                401,
                "Authentication error: send `Authorization: Bearer <API token>`.",
                code="authentication_error",
            )
        if self.open:
            return Principal(tenant=tenant_from(headers))
        entry = self._by_digest.get(token_digest(token))
        if entry is None:
            raise ApiError(401, "Authentication error: invalid API token.", code="invalid_token")
        if account_id is not None and entry.accounts and account_id not in entry.accounts:
            raise ApiError(
                401,
                f"Authentication error: this API token may not use account `{account_id}`.",
                code="authentication_error",
            )
        return Principal(tenant=entry.tenant)
