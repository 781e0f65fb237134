"""Records on local disk, one folder per tenant: safe ids and tenant folders; records are
written with ``foundation.files.write_atomic``.

The Files API's store and the batch records share it. A record is written to a temporary
file, flushed and renamed over the old one, so a reader (or a restart after ``kill -9``)
sees the old record or the new one, never half of one.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from pathlib import Path

_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def new_id(prefix: str) -> str:
    """A fresh id that sorts by creation time (then at random), as lists are ordered."""
    return f"{prefix}{time.time_ns():016x}{uuid.uuid4().hex[:16]}"


def valid_id(value: str) -> bool:
    """Whether ``value`` may name a record (no path separators, dots or odd characters)."""
    return bool(_ID.match(value))


def tenant_key(tenant: str) -> str:
    """The tenant's name in paths and Redis keys: a hash, so any tenant name is safe there."""
    return hashlib.blake2b(tenant.encode(), digest_size=16).hexdigest()


def tenant_dir(root: Path, tenant: str) -> Path:
    """The tenant's folder under ``root``."""
    return root / tenant_key(tenant)


def read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
