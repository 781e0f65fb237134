"""What the key store holds for an API key, and the admin API's views of it.

A record never holds the secret: only its keyed hash (``digest``), and during a rotation's
grace period the previous secret's hash.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from server.limits.budgets import BudgetStatus
from server.limits.settings import LimitSettings

Role = Literal["admin"]

KeyStatus = Literal["active", "expired", "revoked"]


class ApiKey(msgspec.Struct, frozen=True, kw_only=True):
    """One API key as stored (every gateway sharing the store reads the same record)."""

    id: str
    tenant: str
    name: str
    digest: str
    """HMAC-SHA256 of the secret under the server secret (hex)."""
    roles: list[Role] = msgspec.field(default_factory=list)
    models: list[str] | None = None
    """Model ids or aliases this key may use; ``None``: every model."""
    expires_at: float | None = None
    """Seconds since the epoch; ``None``: never."""
    limits: LimitSettings | None = None
    """The key's own limits and budgets (within the ``[limits]`` defaults)."""
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    created_at: float
    created_by: str
    updated_at: float
    revoked_at: float | None = None
    previous_digest: str | None = None
    """The secret before the last rotation, valid until ``previous_valid_until``."""
    previous_valid_until: float | None = None
    version: int = 1

    def status(self, now: float) -> KeyStatus:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and now >= self.expires_at:
            return "expired"
        return "active"

    def public(self, now: float, last_used_at: float | None) -> KeyInfo:
        """What the admin API shows: everything but the hashes."""
        grace = self.previous_valid_until
        return KeyInfo(
            id=self.id,
            tenant=self.tenant,
            name=self.name,
            status=self.status(now),
            roles=list(self.roles),
            models=None if self.models is None else list(self.models),
            expires_at=self.expires_at,
            limits=self.limits,
            metadata=dict(self.metadata),
            created_at=self.created_at,
            created_by=self.created_by,
            updated_at=self.updated_at,
            last_used_at=last_used_at,
            revoked_at=self.revoked_at,
            previous_secret_valid_until=grace if grace is not None and grace > now else None,
        )


class KeyInfo(msgspec.Struct, kw_only=True):
    """An API key as the admin API and the CLI show it (never a secret, never a hash)."""

    object: Literal["api_key"] = "api_key"
    id: str
    tenant: str
    name: str
    status: KeyStatus
    roles: list[Role]
    models: list[str] | None
    expires_at: float | None
    limits: LimitSettings | None
    metadata: dict[str, str]
    created_at: float
    created_by: str
    updated_at: float
    last_used_at: float | None
    revoked_at: float | None
    previous_secret_valid_until: float | None
    spend: list[BudgetStatus] | None = None
    """What the key spent of each of its own budgets (today, this month); ``None``: it has
    none, or the gateway counts no limits."""


class CreatedKey(msgspec.Struct, kw_only=True):
    """A new (or rotated) key and its secret: the only time the secret is shown."""

    key: KeyInfo
    secret: str


class KeyCreate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /admin/keys``."""

    tenant: str
    name: str = ""
    roles: list[Role] = msgspec.field(default_factory=list)
    models: list[str] | None = None
    expires_at: float | None = None
    """Seconds since the epoch."""
    expires_in_s: float | None = None
    """Or: seconds from now."""
    limits: LimitSettings | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)


class KeyUpdate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``PATCH /admin/keys/{id}``: the fields sent change; ``null`` clears an optional one."""

    name: str | msgspec.UnsetType = msgspec.UNSET
    roles: list[Role] | msgspec.UnsetType = msgspec.UNSET
    models: list[str] | msgspec.UnsetType | None = msgspec.UNSET
    expires_at: float | msgspec.UnsetType | None = msgspec.UNSET
    limits: LimitSettings | msgspec.UnsetType | None = msgspec.UNSET
    metadata: dict[str, str] | msgspec.UnsetType = msgspec.UNSET

    def changes(self) -> dict[str, Any]:
        return {
            name: value
            for name in self.__struct_fields__
            if (value := getattr(self, name)) is not msgspec.UNSET
        }


class KeyRotate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /admin/keys/{id}/rotate``: how long the old secret stays valid."""

    grace_s: float = 0.0


class AuditEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One admin change: who, what, when (never a secret)."""

    time: float
    actor: str
    """The admin principal's token id (``name`` of a config token, or ``key:<id>``)."""
    actor_tenant: str
    action: Literal["create", "update", "rotate", "revoke"]
    key_id: str
    tenant: str
    """The key's tenant."""
    changes: dict[str, Any] = msgspec.field(default_factory=dict)
    """The fields set, with their new values (hashes and secrets never)."""


def key_token_id(key_id: str) -> str:
    """How logs and limits name an API key: its id, never its secret."""
    return f"key:{key_id}"
