"""The gateway's key store and view, from the ``[keys]`` settings and the policy's Redis."""

from __future__ import annotations

from pathlib import Path

from server.identity.api_keys.hashing import KeyHasher, load_server_secret
from server.identity.api_keys.redis_store import RedisKeyStore
from server.identity.api_keys.settings import KeySettings
from server.identity.api_keys.store import KeyStore, LocalKeyStore
from server.identity.api_keys.view import KeyView


def build_key_view(
    settings: KeySettings, *, data_dir: Path, redis_url: str | None, redis_prefix: str
) -> KeyView | None:
    """The view (opened in the app's lifespan); ``None`` when keys are off."""
    if not settings.enabled:
        return None
    directory = data_dir / settings.dir
    secret = load_server_secret(settings.configured_secret(), directory / "server-secret")
    store: KeyStore
    if settings.storage == "redis" or (settings.storage == "auto" and redis_url):
        if not redis_url:
            raise ValueError('[keys] storage = "redis" needs [tiers.redis] url in the policy')
        store = RedisKeyStore(redis_url, redis_prefix, audit_keep=settings.audit_keep)
    else:
        store = LocalKeyStore(directory)
    return KeyView(
        store,
        KeyHasher(secret),
        resync_s=settings.resync_s,
        last_used_flush_s=settings.last_used_flush_s,
    )
