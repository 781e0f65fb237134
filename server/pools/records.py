"""One run-time change of a pool: a server added to it or drained out of it."""

from __future__ import annotations

from typing import Literal

import msgspec

from backends.config import ServerRole

MemberState = Literal["added", "drained"]


class MemberChange(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The latest change of one server in one pool; a later change of it replaces this one."""

    backend: str
    role: ServerRole
    url: str
    state: MemberState
    max_inflight: int | None = None
    """The limit it was added with (``None``: the backend's ``max_inflight_per_server``)."""
    at: float
    """When the change was made (Unix seconds)."""

    @property
    def key(self) -> str:
        return member_key(self.backend, self.role, self.url)


def member_key(backend: str, role: str, url: str) -> str:
    """The store's key of a server in a pool (a URL has no space)."""
    return f"{backend} {role} {url.rstrip('/')}"
