"""Which server of a pool takes a request (the same rules pick the prefill and the decode one).

- ``x-session-affinity: <id>`` → rendezvous (highest-random-weight) hashing of the id over the
  pool's healthy servers: a conversation stays on the same prefill and decode servers, and when
  a server joins or leaves only the sessions whose top choice it is move. A full server spills
  the session to its next choice.
- otherwise, with a prompt at least ``prefix_tokens`` long → prefix-aware placement: the
  rendezvous choice for a hash of the prompt's first ``prefix_tokens`` (estimated, see below),
  so requests sharing a system prompt land where its KV blocks are cached, unless that server
  runs more than ``prefix_load_slack`` requests above the least busy one (bounded load).
- otherwise → least outstanding requests (round-robin among ties).

That is the ``prefix-hash`` policy (the default where servers publish no KV events). ``kv``
ranks by the blocks each server reports holding (``backends.fleet.kv.scoring``) when the request's
exact blocks are known (``RouteKey.blocks``), and falls back to ``prefix-hash`` when they are
not;
``least-loaded`` and ``round-robin`` ignore the prompt. Session affinity wins in every policy.

Approximation: the gateway has no tokenizer. It renders the prompt cheaply (chat: tools, then
each message as ``<|role|>`` + text; completions: the prompt string) and counts
``len(text) / chars_per_token`` tokens (4 for English BPE vocabularies; token-id prompts are
counted exactly). The estimate decides the prefill threshold and the prefix window only, so an
error moves a request across the threshold or shifts the window, never changes an answer.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import orjson

from backends.fleet.server_state import ServerState
from backends.kv_settings import PlacementPolicy

if TYPE_CHECKING:
    from backends.fleet.kv.scoring import KvScorer


inflight_of = attrgetter("inflight")

PER_MESSAGE_TOKENS = 4
"""Chat-template tokens around each message (role header, separators), roughly."""


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def rendezvous_order(key: str, servers: Iterable[ServerState]) -> list[ServerState]:
    """``servers`` by decreasing rendezvous score for ``key`` (the first is the owner).

    The score is ``_hash64(f"{key}\\x00{url}")``; the key's part of the hash state is computed
    once and copied per server, and 8 big-endian bytes sort as the integer does."""
    base = hashlib.blake2b(key.encode() + b"\x00", digest_size=8)

    def score(server: ServerState) -> bytes:
        h = base.copy()
        h.update(server.url.encode())
        return h.digest()

    return sorted(servers, key=score, reverse=True)


@dataclass(frozen=True)
class RouteKey:
    """What placement may use: a session id, else the prompt's exact blocks (``kv``) or a
    prompt-prefix hash, else nothing."""

    session: str | None = None
    prefix: str | None = None
    blocks: tuple[int, ...] | None = None
    """The prompt's KV block hashes as vLLM computes them (``kv`` placement)."""
    block_size: int = 0
    prompt_tokens: int = 0


class Placement:
    """Ranks a pool's servers for one request (see the module docstring)."""

    def __init__(
        self,
        prefix_load_slack: int,
        policy: PlacementPolicy = "prefix-hash",
        kv: KvScorer | None = None,
    ) -> None:
        self.slack = prefix_load_slack
        self.policy = policy
        self.kv = kv
        self._rr = itertools.count()

    def least_outstanding(self, servers: Sequence[ServerState]) -> list[ServerState]:
        if not servers:
            return []
        start = next(self._rr) % len(servers)
        rotated = [*servers[start:], *servers[:start]]
        return sorted(rotated, key=inflight_of)  # stable: ties keep the rotation

    @staticmethod
    def any_healthy(servers: Sequence[ServerState], exclude: Iterable[ServerState] = ()) -> bool:
        """Whether :meth:`rank` would name a server: a check that decides nothing (no
        decision counted, no rotation moved)."""
        skip = set(exclude)
        return any(s.healthy and s not in skip for s in servers)

    def rank(
        self,
        servers: Sequence[ServerState],
        key: RouteKey,
        exclude: Iterable[ServerState] = (),
    ) -> list[ServerState]:
        skip = set(exclude)
        healthy = (
            [s for s in servers if s.healthy and s not in skip]
            if skip
            else [s for s in servers if s.healthy]
        )
        if key.session is not None:
            return rendezvous_order(key.session, healthy)
        if self.policy == "round-robin":
            start = next(self._rr) % len(healthy) if healthy else 0
            return [*healthy[start:], *healthy[:start]]
        by_load = self.least_outstanding(healthy)
        if self.policy == "least-loaded" or not by_load:
            return by_load
        if self.policy == "kv" and self.kv is not None:
            if key.blocks:
                return self.kv.rank(by_load, key.blocks, key.block_size, key.prompt_tokens, servers)
            self.kv.decisions.reasons[(by_load[0].role, "fallback")] += 1
        if key.prefix is None:
            return by_load
        ceiling = by_load[0].inflight + self.slack
        preferred = [s for s in rendezvous_order(key.prefix, healthy) if s.inflight <= ceiling]
        taken = {id(s) for s in preferred}
        return preferred + [s for s in by_load if id(s) not in taken]


# -- the prompt, cheaply ---------------------------------------------------------------------


@dataclass(frozen=True)
class PromptShape:
    """A prompt as placement sees it: rendered text (or token ids) and a token estimate."""

    text: str
    token_ids: tuple[int, ...] | None
    approx_tokens: int
    single: bool
    """One prompt (not a batch of completions prompts)."""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
                else:  # images, audio: their reference stands in for them
                    parts.append(orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode())
        return "".join(parts)
    return ""


def _responses_messages(body: dict[str, Any]) -> list[Any]:
    """A Responses API body as chat messages: the instructions, then the input's items (an
    item that is not a message, e.g. a tool call's output, stands in as its JSON)."""
    messages: list[Any] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    for item in items if isinstance(items, list) else ():
        if isinstance(item, dict) and "role" in item:
            messages.append(item)
        else:
            messages.append({"role": "item", "content": orjson.dumps(item).decode()})
    return messages


def prompt_shape(path: str, body: dict[str, Any], chars_per_token: float) -> PromptShape:
    """Render the prompt of a chat, completions or Responses API body without a tokenizer
    (approximate)."""
    if path.endswith("/chat/completions") or path.endswith("/responses"):
        given = body.get("messages")
        messages: list[Any] = given if isinstance(given, list) else []
        if path.endswith("/responses"):
            messages = _responses_messages(body)
        parts = []
        if body.get("tools"):
            parts.append(orjson.dumps(body["tools"], option=orjson.OPT_SORT_KEYS).decode())
        for m in messages:
            if isinstance(m, dict):
                parts.append(f"<|{m.get('role', '')}|>{_content_text(m.get('content'))}\n")
        text = "".join(parts)
        approx = math.ceil(len(text) / chars_per_token) + PER_MESSAGE_TOKENS * len(messages)
        return PromptShape(text, None, approx, True)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return PromptShape(prompt, None, math.ceil(len(prompt) / chars_per_token), True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return PromptShape("", tuple(prompt), len(prompt), True)
    if isinstance(prompt, list) and len(prompt) == 1:
        return prompt_shape(path, {**body, "prompt": prompt[0]}, chars_per_token)
    return PromptShape("", None, 0, False)


def prefix_key(
    shape: PromptShape, scope: str, prefix_tokens: int, chars_per_token: float
) -> str | None:
    """A hash of the prompt's first ``prefix_tokens`` (None for shorter prompts).

    The salt scope is part of it: tenants with different salts share no KV blocks anyway.
    """
    if shape.token_ids is not None:
        if len(shape.token_ids) < prefix_tokens:
            return None
        head = ",".join(map(str, shape.token_ids[:prefix_tokens]))
    else:
        window = int(prefix_tokens * chars_per_token)
        if len(shape.text) < window:
            return None
        head = shape.text[:window]
    return hashlib.blake2b(f"{scope}\x00{head}".encode(), digest_size=16).hexdigest()
