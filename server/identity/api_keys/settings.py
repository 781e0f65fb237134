"""The ``[keys]`` section of the gateway config: where API keys live and how they are hashed."""

from __future__ import annotations

import os
from typing import Literal

import msgspec

from foundation.config_types import PosFloat


class KeySettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    enabled: bool = True
    """Keys made through the admin API authenticate (config tokens always do)."""
    storage: Literal["auto", "local", "redis"] = "auto"
    """``auto``: the policy's ``[tiers.redis]`` when it names one, else local files."""
    dir: str = "keys"
    """Local store, server secret file and audit log, under ``data_dir``."""
    secret_env: str = "SEMCACHE_KEYS_SECRET"
    """Variable holding the server secret of the keyed hash; unset: ``<dir>/server-secret``,
    made on first start. Gateways sharing a Redis store need the same secret."""
    resync_s: PosFloat = 30.0
    """Every gateway reads the whole store this often too (pub/sub messages can be lost
    while a connection is down)."""
    last_used_flush_s: PosFloat = 5.0
    """How often the keys' last use is written to the store."""
    audit_keep: int = 100_000
    """Audit entries kept in Redis (the local log is a file that is never trimmed)."""

    def configured_secret(self) -> str | None:
        return os.environ.get(self.secret_env) or None
