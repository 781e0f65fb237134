"""Request headers the tests send."""

from __future__ import annotations


def bearer(token: str, *, json: bool = False) -> dict[str, str]:
    """The ``authorization`` header carrying ``token``; with ``json``, a JSON ``content-type``
    too (for bodies sent as raw ``content=``, which httpx does not label)."""
    headers = {"authorization": f"Bearer {token}"}
    if json:
        headers["content-type"] = "application/json"
    return headers
