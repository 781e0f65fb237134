"""The ``[pools]`` section of the gateway config: where run-time pool changes are kept."""

from __future__ import annotations

from typing import Literal

import msgspec

from foundation.config_types import NonEmptyStr, PosFloat


class MembershipSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    storage: Literal["auto", "local", "redis", "off"] = "auto"
    """Where servers added and drained through the admin API are kept: ``local`` (a file
    under ``data_dir``: a restart keeps them), ``redis`` (the policy's ``[tiers.redis]``:
    every gateway on it applies them, a restart keeps them), ``auto`` (``redis`` when the
    policy names one, else ``local``) or ``off`` (a restart serves the config's servers)."""
    file: NonEmptyStr = "pools/membership.json"
    """The local store, under ``data_dir``."""
    resync_s: PosFloat = 30.0
    """Every gateway reads the whole store this often too (a pub/sub message can be lost
    while a connection is down)."""
