"""The gateway's pool membership, from the ``[pools]`` settings and the policy's Redis."""

from __future__ import annotations

from pathlib import Path

from backends.registry import ModelRegistry
from server.pools.redis_store import RedisMembershipStore
from server.pools.settings import MembershipSettings
from server.pools.store import LocalMembershipStore, MembershipStore
from server.pools.sync import PoolMembership


def build_membership(
    settings: MembershipSettings,
    registry: ModelRegistry,
    *,
    data_dir: Path,
    redis_url: str | None,
    redis_prefix: str,
) -> PoolMembership | None:
    """Started in the app's lifespan; ``None`` when run-time changes are not kept."""
    if settings.storage == "off":
        return None
    store: MembershipStore
    if settings.storage == "redis" or (settings.storage == "auto" and redis_url):
        if not redis_url:
            raise ValueError('[pools] storage = "redis" needs [tiers.redis] url in the policy')
        store = RedisMembershipStore(redis_url, redis_prefix)
    else:
        store = LocalMembershipStore(data_dir / settings.file)
    return PoolMembership(store, registry, resync_s=settings.resync_s)
