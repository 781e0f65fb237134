"""The admin token: a bearer token that authenticates as an admin principal of tenant ``admin``.

Set in the gateway config, inline or (better) through an environment variable::

    [auth.admin]
    token_env = "SEMCACHE_ADMIN_TOKEN"   # the default; `token = "..."` also works

A cache policy's ``[admin]`` table (same fields) is still accepted: the policy warns when it
loads one, and the gateway config's ``[auth.admin]`` wins when both are set. Without either,
the token is ``$SEMCACHE_ADMIN_TOKEN`` when that variable is set.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Final

import msgspec

from semcache.policy import AdminTable, Policy, PolicyHolder

ADMIN_TOKEN_ENV: Final = "SEMCACHE_ADMIN_TOKEN"

log = logging.getLogger(__name__)


class AdminSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[auth.admin]``: who may purge, reload the policy and read every tenant's usage."""

    token: str | None = None
    token_env: str | None = ADMIN_TOKEN_ENV
    """The environment variable holding the token; it wins over ``token`` when set."""

    def resolve_token(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The admin token (environment variable first), or None when none is configured."""
        env = os.environ if environ is None else environ
        if self.token_env and env.get(self.token_env):
            return env[self.token_env]
        return self.token or None


def from_policy(table: AdminTable | None) -> AdminSettings:
    """The settings a policy's ``[admin]`` table gives (the defaults without one)."""
    if table is None:
        return AdminSettings()
    return msgspec.convert(msgspec.to_builtins(table), AdminSettings)


def admin_token(settings: AdminSettings | None, policy: PolicyHolder) -> Callable[[], str | None]:
    """The admin token now, as authentication asks for it (``None``: there is none).

    ``settings`` (the gateway config's ``[auth.admin]``) is resolved once. Without it, the
    policy's ``[admin]`` table is, once per policy snapshot: at the first request, then again
    after each policy reload.
    """
    if settings is not None:
        if policy.current.admin is not None:
            log.warning(
                "policy %s: [admin] is ignored: the gateway config sets [auth.admin]",
                policy.current.source,
            )
        resolved = settings.resolve_token()
        return lambda: resolved
    seen: tuple[Policy, str | None] | None = None

    def token() -> str | None:
        nonlocal seen
        current = policy.current
        if seen is None or seen[0] is not current:
            seen = (current, from_policy(current.admin).resolve_token())
        return seen[1]

    return token
