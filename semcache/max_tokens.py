"""A rule's bound on the tokens an answer may generate: a default for requests that name
none and a cap on those that do (chat, completions and responses; other routes ignore it).

Cloudflare's Workers AI gives each text-generation model a default ``max_tokens`` (256);
vLLM, asked for none, generates up to the model's context. A policy says it per route and
per model like any rule field; what the gateway applied is said in the answer's usage
(``server/serving/output_limit.py``).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import msgspec

from foundation.config_types import NonNegInt

Source = Literal["default", "cap"]


class Applied(NamedTuple):
    """The ``max_tokens`` the gateway sent and why: the rule's ``default`` (the request
    named none) or its ``cap`` (the request asked for more, or named none and the rule has
    only a cap)."""

    value: int
    source: Source


class MaxTokens(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[… .max_tokens]`` of a policy rule; 0 (the default of both) is none."""

    default: NonNegInt = 0
    """Sent when a request names no ``max_tokens`` (never above ``cap``)."""
    cap: NonNegInt = 0
    """The most a request may ask; a larger value is lowered to it."""

    def applied(self, asked: int | None) -> Applied | None:
        """What to send for a request that asked ``asked`` (``None``: named none); ``None``
        when the request's own value stands or there is nothing to apply."""
        if asked is not None:
            return Applied(self.cap, "cap") if self.cap and asked > self.cap else None
        if self.default:
            return Applied(min(self.default, self.cap or self.default), "default")
        return Applied(self.cap, "cap") if self.cap else None
