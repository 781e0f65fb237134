"""Secrets and their keyed hash: the prefix, the randomness, the server secret's file."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from server.identity.api_keys.hashing import (
    KEY_PREFIX,
    KeyHasher,
    load_server_secret,
    looks_like_key,
    new_key_id,
    new_secret,
)


def test_a_secret_names_its_key_and_is_random() -> None:
    key_id = new_key_id()
    first, second = new_secret(key_id), new_secret(key_id)
    assert first.startswith(f"{KEY_PREFIX}{key_id}-") and looks_like_key(first)
    assert first != second
    assert len(first) - len(f"{KEY_PREFIX}{key_id}-") >= 43  # 32 random bytes, base64


def test_the_hash_is_keyed_by_the_server_secret() -> None:
    secret = new_secret(new_key_id())
    one, other = KeyHasher(b"a" * 32), KeyHasher(b"b" * 32)
    assert one.digest(secret) == one.digest(secret)
    assert one.digest(secret) != other.digest(secret)
    assert secret not in one.digest(secret)
    assert KeyHasher.same(one.digest(secret), one.digest(secret))
    assert not KeyHasher.same(one.digest(secret), other.digest(secret))


def test_a_short_server_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        KeyHasher(b"short")


def test_the_server_secret_file_is_made_once_private(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "server-secret"
    made = load_server_secret(None, path)
    assert len(made) == 64
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_server_secret(None, path) == made
    assert load_server_secret("configured-secret-value", path) == b"configured-secret-value"
