"""vLLM ``cache_salt`` per salt scope: one tenant's prompts never hit (or time) another's KV.

vLLM mixes a request's ``cache_salt`` into the hash of its first KV block, so two requests share
prefix-cache blocks only when their salts are equal. The gateway derives the salt from the
request's salt scope (the tenant, or ``"shared"`` for models the policy shares) with a keyed
hash: a client cannot compute another tenant's salt, and the salt reveals nothing about the
tenant. The key comes from the environment or the config; without one a random key is drawn
per process (the salts then change on restart and differ between gateways, which only costs
prefix-cache hits).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from collections.abc import Mapping

from backends.config import VllmBackendConfig

log = logging.getLogger("semcache.backends")

SHARED_SCOPE = "shared"
ANONYMOUS_SCOPE = "anonymous"
"""The scope of a request that names none (same bucket as requests without an API key)."""


class CacheSalter:
    """Maps a salt scope to vLLM's ``cache_salt`` (32 hex characters, stable for one key)."""

    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ValueError("the cache-salt secret must not be empty")
        self._key = hashlib.sha256(secret).digest()

    @classmethod
    def from_config(
        cls, config: VllmBackendConfig, environ: Mapping[str, str] | None = None
    ) -> CacheSalter:
        """The secret from ``cache_salt_secret_env``, then ``cache_salt_secret``, else random."""
        env = os.environ if environ is None else environ
        name = config.cache_salt_secret_env
        secret = (env.get(name) if name else None) or config.cache_salt_secret
        if not secret:
            log.warning(
                "backend %s: no cache-salt secret configured (%s); using a random one: vLLM "
                "prefix caches are not shared across gateway restarts or instances",
                config.name,
                name or "cache_salt_secret",
            )
            return cls(secrets.token_bytes(32))
        return cls(secret.encode())

    def salt(self, scope: str | None) -> str:
        """The ``cache_salt`` of ``scope`` (None counts as the anonymous scope)."""
        data = (scope or ANONYMOUS_SCOPE).encode()
        digest = hashlib.blake2b(data, key=self._key, digest_size=16, person=b"semcache-salt")
        return digest.hexdigest()
