"""The admin operations on API keys: create, update, rotate, revoke, each written to the
audit log; the admin routes and the dashboard call these."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import Any

import msgspec

from server.errors import ApiError
from server.identity.api_keys.hashing import KeyHasher, new_key_id, new_secret
from server.identity.api_keys.records import (
    ApiKey,
    AuditEntry,
    CreatedKey,
    KeyCreate,
    KeyInfo,
    KeyRotate,
    KeyUpdate,
    key_token_id,
)
from server.identity.api_keys.view import KeyView
from server.limits.key_budgets import split_budgets
from server.limits.limiter import TenantLimiter
from server.limits.settings import LimitSettings


class Actor(msgspec.Struct, frozen=True):
    """Who makes an admin change, as the audit log names them."""

    token_id: str
    tenant: str


def key_not_found(key_id: str) -> ApiError:
    return ApiError(404, f"No API key `{key_id}`.", param="id", code="key_not_found")


class KeyAdmin:
    def __init__(
        self,
        view: KeyView,
        *,
        defaults: LimitSettings,
        config_tokens: Collection[str],
        clock: Callable[[], float] | None = None,
        limiter: TenantLimiter | None = None,
        served: Callable[[str], bool] | None = None,
    ) -> None:
        """``limiter``: where a key's spend against its own budgets is read.
        ``config_tokens``: how the config's ``[[auth.tokens]]`` are named (their
        ``name``, or their digest's first 12 hex digits): the API refuses to change them.
        ``served``: whether this gateway serves a model id or alias; a key scoped to a
        model it does not is refused (``None``: any name)."""
        self.view = view
        self.served = served
        self.store = view.store
        self.hasher: KeyHasher = view.hasher
        self.defaults = defaults
        self.config_tokens = frozenset(config_tokens)
        self.clock = clock or view.clock
        self.limiter = limiter

    def info(self, key: ApiKey) -> KeyInfo:
        return key.public(self.clock(), self.view.last_used(key.id))

    async def list_keys(self, tenant: str | None = None) -> list[KeyInfo]:
        used = await self.store.last_used()
        now = self.clock()
        keys = sorted(await self.store.load_all(), key=lambda k: (k.created_at, k.id))
        return [
            await self._with_spend(k, k.public(now, self.view.last_used(k.id) or used.get(k.id)))
            for k in keys
            if tenant is None or k.tenant == tenant
        ]

    async def show(self, key_id: str) -> KeyInfo:
        key = await self._get(key_id)
        used = self.view.last_used(key.id) or (await self.store.last_used()).get(key.id)
        return await self._with_spend(key, key.public(self.clock(), used))

    async def _with_spend(self, key: ApiKey, info: KeyInfo) -> KeyInfo:
        """``info`` with the key's spend against its own budgets, when it has some."""
        _, own = split_budgets(key.limits)
        if own is None or self.limiter is None:
            return info
        info.spend = await self.limiter.key_budgets.status(
            key_token_id(key.id), own, self.limiter.calendar()
        )
        return info

    async def create(self, req: KeyCreate, actor: Actor) -> CreatedKey:
        if not req.tenant.strip():
            raise ApiError(400, "`tenant` must not be empty.", param="tenant")
        self._check_limits(req.limits)
        self._check_models(req.models)
        now = self.clock()
        expires_at = req.expires_at
        if req.expires_in_s is not None:
            if expires_at is not None:
                raise ApiError(
                    400, "Send `expires_at` or `expires_in_s`, not both.", param="expires_in_s"
                )
            expires_at = now + req.expires_in_s
        key_id = new_key_id()
        secret = new_secret(key_id)
        key = ApiKey(
            id=key_id,
            tenant=req.tenant,
            name=req.name or key_id,
            digest=self.hasher.digest(secret),
            roles=list(req.roles),
            models=req.models,
            expires_at=expires_at,
            limits=req.limits,
            metadata=req.metadata,
            created_at=now,
            created_by=actor.token_id,
            updated_at=now,
        )
        await self._save(key)
        await self._audit(actor, "create", key, _visible(msgspec.to_builtins(req)))
        return CreatedKey(key=self.info(key), secret=secret)

    async def update(self, key_id: str, req: KeyUpdate, actor: Actor) -> KeyInfo:
        key = await self._get(key_id, changing=True)
        changes = req.changes()
        if "limits" in changes:
            self._check_limits(changes["limits"])
        if "models" in changes:
            self._check_models(changes["models"])
        if "name" in changes and not changes["name"]:
            changes["name"] = key.id
        key = msgspec.structs.replace(
            key, **changes, updated_at=self.clock(), version=key.version + 1
        )
        await self._save(key)
        await self._audit(actor, "update", key, msgspec.to_builtins(changes))
        return self.info(key)

    async def rotate(self, key_id: str, req: KeyRotate, actor: Actor) -> CreatedKey:
        if req.grace_s < 0 or not math.isfinite(req.grace_s):
            raise ApiError(400, "`grace_s` must be 0 or more seconds.", param="grace_s")
        key = await self._get(key_id, changing=True)
        now = self.clock()
        secret = new_secret(key.id)
        key = msgspec.structs.replace(
            key,
            digest=self.hasher.digest(secret),
            previous_digest=key.digest if req.grace_s > 0 else None,
            previous_valid_until=now + req.grace_s if req.grace_s > 0 else None,
            updated_at=now,
            version=key.version + 1,
        )
        await self._save(key)
        await self._audit(actor, "rotate", key, {"grace_s": req.grace_s})
        return CreatedKey(key=self.info(key), secret=secret)

    async def revoke(self, key_id: str, actor: Actor) -> KeyInfo:
        key = await self._get(key_id, changing=True)
        if key.revoked_at is not None:
            return self.info(key)
        now = self.clock()
        key = msgspec.structs.replace(key, revoked_at=now, updated_at=now, version=key.version + 1)
        await self._save(key)
        await self._audit(actor, "revoke", key, {})
        return self.info(key)

    async def audit_log(self, limit: int) -> list[AuditEntry]:
        return await self.store.read_audit(limit)

    # --- helpers -------------------------------------------------------------------------

    async def _get(self, key_id: str, *, changing: bool = False) -> ApiKey:
        key = await self.store.get(key_id)
        if key is None:
            if key_id in self.config_tokens:
                verb = "changed or revoked" if changing else "managed"
                raise ApiError(
                    409,
                    f"`{key_id}` is a token listed in the gateway config ([[auth.tokens]]): "
                    f"it cannot be {verb} through the API. Edit the config file instead.",
                    param="id",
                    code="config_token",
                )
            raise key_not_found(key_id)
        return key

    async def _save(self, key: ApiKey) -> None:
        await self.store.put(key)
        self.view.apply(key)  # this gateway at once; the others through the change feed

    async def _audit(self, actor: Actor, action: Any, key: ApiKey, changes: dict[str, Any]) -> None:
        entry = AuditEntry(
            time=self.clock(),
            actor=actor.token_id,
            actor_tenant=actor.tenant,
            action=action,
            key_id=key.id,
            tenant=key.tenant,
            changes=changes,
        )
        await self.store.audit(entry)

    def _check_models(self, models: list[str] | None) -> None:
        """Every model a key is scoped to is one this gateway serves: a key limited to
        unknown names could use nothing (its ``/v1/models`` would be empty)."""
        unknown = [m for m in models or () if self.served is not None and not self.served(m)]
        if unknown:
            raise ApiError(
                400,
                f"No model {', '.join(f'`{m}`' for m in unknown)} is served by this gateway; "
                "a key's `models` are ids or aliases of its models (GET /v1/models lists them).",
                param="models",
                code="model_not_found",
            )

    def _check_limits(self, limits: LimitSettings | None) -> None:
        """A key's limits lie within the defaults every token of its tenant has."""
        if limits is None:
            return
        for name in LimitSettings.__struct_fields__:
            own, default = getattr(limits, name), getattr(self.defaults, name)
            if name == "hits_spend_tokens" or own is None or default is None:
                continue
            if own > default:
                raise ApiError(
                    400,
                    f"`limits.{name}` = {own} is above the gateway's [limits] {name} = "
                    f"{default}: a key's limits lie within its tenant's.",
                    param=f"limits.{name}",
                    code="invalid_value",
                )


def _visible(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields of a request that the audit log keeps (every one that is set)."""
    return {k: v for k, v in fields.items() if v not in (None, [], {}, "")}
