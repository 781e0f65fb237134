"""Secrets of API keys: how they are made, and the keyed hash that is all a store keeps.

A secret is ``sk-sc-<id>-<random>``: the prefix says what it is (secret scanners and people
recognise it), the id names the key in logs and errors without revealing the secret, and
32 random bytes (``secrets.token_urlsafe``) make it unguessable. The store keeps
HMAC-SHA256 of the whole secret under the server secret, so a copy of the store (a Redis
dump, a backup) lets nobody authenticate, nor test guesses without the server secret.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

KEY_PREFIX = "sk-sc-"

_ID_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"


def new_key_id() -> str:
    """A short, random, lower-case id (12 characters of base 36)."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(12))


def new_secret(key_id: str) -> str:
    return f"{KEY_PREFIX}{key_id}-{secrets.token_urlsafe(32)}"


def looks_like_key(token: str) -> bool:
    return token.startswith(KEY_PREFIX)


class KeyHasher:
    """HMAC-SHA256 under the server secret."""

    def __init__(self, server_secret: bytes) -> None:
        if len(server_secret) < 16:
            raise ValueError("the key store's server secret must be at least 16 bytes")
        self._secret = server_secret

    def digest(self, token: str) -> str:
        return hmac.new(self._secret, token.encode(), hashlib.sha256).hexdigest()

    @staticmethod
    def same(a: str, b: str) -> bool:
        """Constant-time comparison of two digests."""
        return hmac.compare_digest(a.encode(), b.encode())


def load_server_secret(configured: str | None, path: Path) -> bytes:
    """The server secret: the configured one, else the file at ``path``, made on first use
    (32 random bytes, hex, mode 0600). Gateways sharing a store need the same secret."""
    if configured:
        return configured.encode()
    try:
        return path.read_text().strip().encode()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_hex(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it first
        return path.read_text().strip().encode()
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value.encode()
