"""Cache policy files: a msgspec schema for TOML, validated once, merged into per-route rules.

A policy has a ``defaults`` rule, per-route rules, per-model rules and per-model-per-route
rules. Each layer is a *partial* override of the one below it::

    defaults < routes.<route> < models."<id>" < models."<id>".routes.<route>

Nested tables (``semantic``, ``prices``, ``max_tokens``) are merged field by field too.
Every merged rule is computed at load time, so :meth:`Policy.rule` is a dictionary lookup.
The format is documented in ``policies/README.md``; ``policies/default.toml`` is the
embedded default.
"""

from __future__ import annotations

import logging
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Literal, TypeVar, get_args

import msgspec

from foundation.config_types import NonNegFloat, NonNegInt
from foundation.package_files import package_file
from semcache import guard_rules
from semcache.cache_keys import SHARED_SCOPE, group_scope, scope_for
from semcache.guard_rules import DlpRule, GuardrailRule, GuardRule, GuardSettings
from semcache.max_tokens import MaxTokens
from semcache.semantic_settings import SemanticRule
from semcache.tier_settings import DiskTier as DiskTier  # the tiers' settings, re-exported
from semcache.tier_settings import MemoryTier as MemoryTier
from semcache.tier_settings import RedisTier as RedisTier
from semcache.tier_settings import SemanticTier as SemanticTier
from semcache.tier_settings import TierSettings

Route = Literal[
    "chat",
    "completions",
    "responses",
    "embeddings",
    "classification",
    "rerank",
    "tokenize",
    "detokenize",
]
ROUTES: Final[tuple[str, ...]] = get_args(Route)

Reveal = Literal["status", "age", "saved", "semantic"]
"""What a response under a sharing rule may say of the cache: ``status`` (``cf-aig-cache-status``
and ``Cache-Status`` say HIT), ``age`` (``Age``, the entry's TTL left), ``saved``
(``x-semcache-saved-*``), ``semantic`` (``x-semcache-semantic*``)."""
REVEALABLE: Final[frozenset[str]] = frozenset(get_args(Reveal))

DEFAULT_POLICY: Final[Path] = package_file("semcache", "policies", "default.toml")
"""The embedded default: the top-level ``policies/default.toml``, which ``semcache/policies``
(a link to ``policies/``) ships as package data."""


T = TypeVar("T")
log = logging.getLogger("semcache.policy")


class PolicyError(Exception):
    """A policy file is missing, unreadable or invalid; the message names file and field."""


# --------------------------------------------------------------------------- resolved rule


class Prices(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """USD per million tokens, used to count the money a cache hit saved."""

    input_per_m: NonNegFloat = 0.0
    output_per_m: NonNegFloat = 0.0
    cached_input_per_m: NonNegFloat | None = None
    """The price of a prompt token vLLM's prefix cache answered (OpenAI's and Anthropic's
    "cached input"); ``None``: ``input_per_m``, so the prefix cache saves nothing in money."""

    def cost_usd(self, prompt_tokens: int, completion_tokens: int, prefix_cached: int = 0) -> float:
        """What the backend would have cost for this many tokens, ``prefix_cached`` of the
        prompt's at the cached input price."""
        cached = min(max(prefix_cached, 0), prompt_tokens)
        cached_price = self.cached_input_per_m
        if cached_price is None:
            cached_price = self.input_per_m
        return (
            (prompt_tokens - cached) * self.input_per_m
            + cached * cached_price
            + completion_tokens * self.output_per_m
        ) / 1e6

    def prefix_saved_usd(self, prefix_cached: int) -> float:
        """What ``prefix_cached`` prompt tokens from vLLM's prefix cache saved against the
        input price (0 unless ``cached_input_per_m`` is set lower)."""
        if self.cached_input_per_m is None:
            return 0.0
        return max(prefix_cached, 0) * max(self.input_per_m - self.cached_input_per_m, 0.0) / 1e6


class CacheRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The merged cache rule for one (model, route)."""

    cacheable: bool = True
    ttl_s: NonNegInt = 3600
    """How long a stored answer is fresh. 0 stores nothing."""
    max_ttl_s: NonNegInt = 86_400
    """Upper bound for a TTL asked by a request (``cf-aig-cache-ttl``, ``max-age``)."""
    swr_s: NonNegInt = 0
    """stale-while-revalidate window after expiry (RFC 5861); 0 disables it."""
    shared: bool | str = False
    """Who shares the answers: ``false`` each tenant its own (the key's scope is the tenant),
    ``true`` every tenant (scope ``shared``), or the name of a ``[share_groups]`` entry: its
    members share (scope ``group:<name>``), everyone else keeps a scope of their own."""
    reveal: tuple[Reveal, ...] = ()
    """Under a sharing rule, what the cache headers may say (:data:`Reveal`); by default
    nothing: every answer looks like a miss that was stored, to every tenant, so that no
    tenant learns from a header what another sent. A tenant-scoped rule tells everything."""
    deterministic_only: bool = True
    """Only cache requests with temperature 0 (or greedy top_k=1) or a fixed seed."""
    semantic: SemanticRule = msgspec.field(default_factory=SemanticRule)
    prices: Prices = msgspec.field(default_factory=Prices)
    log_bodies: bool = False
    """The request log keeps this route's request and response bodies (off: never)."""
    dlp: DlpRule = msgspec.field(default_factory=DlpRule)
    """Data-loss prevention: entity types per direction and their actions (docs/dlp.md)."""
    guardrails: GuardrailRule = msgspec.field(default_factory=GuardrailRule)
    """A classification model scoring prompts and answers (docs/dlp.md)."""
    max_tokens: MaxTokens = msgspec.field(default_factory=MaxTokens)
    """Generation routes: the default and the cap of a request's ``max_tokens``."""


# --------------------------------------------------------------------------- file schema


class _RulePatch(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One layer of a policy file: any subset of the rule fields.

    Only used to validate a layer with precise error paths; merging works on the raw tables
    so that a partial ``semantic`` or ``prices`` table overrides only the fields it names.
    """

    cacheable: bool | msgspec.UnsetType = msgspec.UNSET
    ttl_s: NonNegInt | msgspec.UnsetType = msgspec.UNSET
    max_ttl_s: NonNegInt | msgspec.UnsetType = msgspec.UNSET
    swr_s: NonNegInt | msgspec.UnsetType = msgspec.UNSET
    shared: bool | str | msgspec.UnsetType = msgspec.UNSET
    reveal: tuple[Reveal, ...] | msgspec.UnsetType = msgspec.UNSET
    deterministic_only: bool | msgspec.UnsetType = msgspec.UNSET
    semantic: SemanticRule | msgspec.UnsetType = msgspec.UNSET
    prices: Prices | msgspec.UnsetType = msgspec.UNSET
    log_bodies: bool | msgspec.UnsetType = msgspec.UNSET
    dlp: DlpRule | msgspec.UnsetType = msgspec.UNSET
    guardrails: GuardrailRule | msgspec.UnsetType = msgspec.UNSET
    max_tokens: MaxTokens | msgspec.UnsetType = msgspec.UNSET


class AdminTable(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A policy's ``[admin]`` table: the admin token, which belongs in the gateway config's
    ``[auth.admin]``. Accepted with a warning; a field left out keeps that table's default."""

    token: str | msgspec.UnsetType | None = msgspec.UNSET
    token_env: str | msgspec.UnsetType | None = msgspec.UNSET


ADMIN_MOVED: Final = (
    "[admin]: the admin token belongs in the gateway config's [auth.admin] table (same "
    "fields); this one is still read while the gateway config sets none"
)


class ShareGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Tenants and API keys that share the answers of the rules naming this group."""

    tenants: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()
    """API keys by id (``key:<id>``, as ``semcache keys`` shows them) or config tokens by
    ``name``: a member key shares with the group whatever its tenant."""

    def __contains__(self, who: object) -> bool:
        tenant, token = who if isinstance(who, tuple) else (who, None)
        return tenant in self.tenants or (token is not None and token in self.keys)


class _PolicyHead(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Top level of a policy file; rule layers stay raw tables and are checked one by one."""

    version: Literal[1] = 1
    tiers: TierSettings = msgspec.field(default_factory=TierSettings)
    admin: AdminTable | None = None
    share_groups: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    defaults: dict[str, Any] = msgspec.field(default_factory=dict)
    routes: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    models: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    guard: GuardSettings = msgspec.field(default_factory=GuardSettings)


# --------------------------------------------------------------------------- loaded policy


class Policy(msgspec.Struct, frozen=True, kw_only=True):
    """A validated policy snapshot. Immutable: reloading builds a new one."""

    source: str
    tiers: TierSettings
    defaults: CacheRule
    route_rules: dict[str, CacheRule]
    """Rule per route for models without their own table."""
    model_rules: dict[tuple[str, str], CacheRule]
    """Rule per (model id, route) for models named in the file."""
    share_groups: dict[str, ShareGroup] = msgspec.field(default_factory=dict)
    logs_bodies: bool = False
    """Some rule asks the request log for bodies."""
    admin: AdminTable | None = None
    """The file's ``[admin]`` table, if it has one (see :class:`AdminTable`)."""
    warnings: tuple[str, ...] = ()
    """What ``semcache policy check`` and the gateway's start and reloads print: rules that
    share answers across every tenant (see :func:`_check_sharing`), an ``[admin]`` table."""
    guard: GuardSettings = msgspec.field(default_factory=GuardSettings)
    """``[guard]``: custom detectors, the stream window, per-tenant and per-key patches."""
    guarded: bool = False
    """Some rule or patch names a detector or a guardrail (else nothing is inspected)."""
    _guard_rules: dict[Any, GuardRule] = msgspec.field(default_factory=dict)

    def guard_rule(self, rule: CacheRule, tenant: str | None, token: str | None) -> GuardRule:
        """What the detectors and guardrails do for a request under ``rule`` by ``tenant``
        (through ``token``): the rule's tables, patched by the tenant's and the key's."""
        if not self.guarded:
            return guard_rules.NO_GUARD
        return guard_rules.for_request(self.guard, self._guard_rules, rule, tenant, token)

    def scope(self, rule: CacheRule, tenant: str | None, token: str | None = None) -> str:
        """The key scope of a request by ``tenant`` (through the API key or config token
        named ``token``) under ``rule``: see :attr:`CacheRule.shared`."""
        if rule.shared is True:
            return SHARED_SCOPE
        if isinstance(rule.shared, str):
            group = self.share_groups.get(rule.shared)
            if group is not None and (tenant, token) in group:
                return group_scope(rule.shared)
        return scope_for(tenant, shared=False)

    def rule(self, model_id: str, route: str) -> CacheRule:
        """The merged rule for a model (gateway model id, aliases resolved) and route.

        An unknown route gets the ``defaults`` rule.
        """
        found = self.model_rules.get((model_id, route))
        if found is not None:
            return found
        return self.route_rules.get(route, self.defaults)

    @property
    def model_ids(self) -> frozenset[str]:
        """Models named in the file (the server may check them against its registry)."""
        return frozenset(m for m, _ in self.model_rules)


# --------------------------------------------------------------------------- loading

_PATH_IN_MSG = re.compile(r"`\$([^`]*)`")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else f'"{key}"'


def _convert(obj: object, typ: type[T], source: str, path: str) -> T:
    """``msgspec.convert`` with errors rewritten to ``FILE: dotted.toml.path: message``."""
    try:
        return msgspec.convert(obj, typ)
    except msgspec.ValidationError as exc:
        what, _, loc = str(exc).partition(" - at ")
        m = _PATH_IN_MSG.search(loc)
        inner = m.group(1).lstrip(".") if m else ""
        where = ".".join(p for p in (path, inner) if p) or "(top level)"
        if loc.startswith("`key`"):
            what += " (as a table key)"
        raise PolicyError(f"{source}: {where}: {what}") from None


def _merge(base: dict[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in patch.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _check_layer(table: Mapping[str, Any], source: str, path: str) -> dict[str, Any]:
    _convert(table, _RulePatch, source, path)
    return dict(table)


def _resolve(merged: dict[str, Any], source: str, path: str, route: str | None = None) -> CacheRule:
    table = merged.get("semantic")
    if isinstance(table, Mapping) and table.get("mode") == "verified" and "enabled" not in table:
        merged = {**merged, "semantic": {**table, "enabled": True}}  # the mode turns it on
    rule = _convert(merged, CacheRule, source, path)
    if rule.ttl_s > rule.max_ttl_s:
        raise PolicyError(
            f"{source}: {path}.ttl_s: {rule.ttl_s} is above max_ttl_s ({rule.max_ttl_s}); "
            "expected ttl_s <= max_ttl_s"
        )
    sem = rule.semantic
    if sem.min_threshold > sem.threshold:
        raise PolicyError(
            f"{source}: {path}.semantic.min_threshold: {sem.min_threshold} is above threshold "
            f"({sem.threshold}); expected min_threshold <= threshold"
        )
    if sem.mode == "verified" and route != "chat":
        raise PolicyError(
            f'{source}: {path}.semantic.mode: "verified" applies to the chat route only; '
            "expected it under routes.chat.semantic"
        )
    if sem.mode == "verified" and sem.judge == "model" and not sem.judge_model:
        raise PolicyError(
            f'{source}: {path}.semantic.judge_model: missing; judge = "model" asks a chat '
            'model of the config; expected its id, e.g. judge_model = "judge-chat"'
        )
    revealed = set(rule.reveal)
    if revealed - {"status"} and "status" not in revealed:
        raise PolicyError(
            f'{source}: {path}.reveal: {sorted(revealed)} without "status"; the other headers '
            'only describe a hit: expected "status" in the list too'
        )
    if sem.mode == "verified" and sem.max_error >= 0.5:
        raise PolicyError(
            f"{source}: {path}.semantic.max_error: {sem.max_error} is not a bound on wrong "
            "answers; expected max_error < 0.5"
        )
    return rule


def _check_routes(routes: Mapping[str, Any], source: str, path: str) -> None:
    for name in routes:
        if name not in ROUTES:
            raise PolicyError(
                f"{source}: {path}.{_toml_key(name)}: unknown route; expected one of "
                f"{', '.join(ROUTES)}"
            )


SHARING_RISK: Final = (
    "any tenant can learn whether another tenant sent a text (with the semantic cache, one "
    "close to it) from how fast it is answered: a hit takes about a millisecond, a miss the "
    "backend's time{headers}. Share public data only, or share within one organisation's "
    "tenants ([share_groups]); docs/cache.md, 'Sharing between tenants'"
)


def _layers(head: _PolicyHead) -> list[tuple[str, Mapping[str, Any]]]:
    """Every rule layer of the file with its dotted path."""
    out: list[tuple[str, Mapping[str, Any]]] = [("defaults", head.defaults)]
    out += [(f"routes.{r}", t) for r, t in head.routes.items()]
    for model_id, table in head.models.items():
        mpath = f"models.{_toml_key(model_id)}"
        out.append((mpath, table))
        per_route = table.get("routes", {})
        if isinstance(per_route, Mapping):
            out += [(f"{mpath}.routes.{r}", t) for r, t in per_route.items()]
    return out


def _share_groups(head: _PolicyHead, source: str) -> dict[str, ShareGroup]:
    groups = {}
    for name, table in head.share_groups.items():
        path = f"share_groups.{_toml_key(name)}"
        group = _convert(table, ShareGroup, source, path)
        if not group.tenants and not group.keys:
            raise PolicyError(f"{source}: {path}: an empty group; expected `tenants` or `keys`")
        groups[name] = group
    return groups


def _check_sharing(head: _PolicyHead, source: str) -> tuple[str, ...]:
    """Share groups named by rules exist; the warnings of rules that share with every
    tenant."""
    warnings: list[str] = []
    for path, table in _layers(head):
        shared = table.get("shared")
        if isinstance(shared, str) and shared not in head.share_groups:
            known = ", ".join(sorted(head.share_groups)) or "none is defined"
            raise PolicyError(
                f"{source}: {path}.shared: no share group {shared!r}; expected true, false "
                f"or a [share_groups] name ({known})"
            )
        if shared is True:
            reveal = table.get("reveal")
            said = f", and its headers say so (reveal = {list(reveal)})" if reveal else ""
            warnings.append(
                f"{path}: shared = true shares answers across every tenant: "
                + SHARING_RISK.format(headers=said)
            )
    return tuple(warnings)


def parse_policy(data: Mapping[str, Any], source: str = "<policy>") -> Policy:
    """Validate a decoded TOML document and precompute every merged rule."""
    head = _convert(data, _PolicyHead, source, "")
    base = _check_layer(head.defaults, source, "defaults")
    defaults = _resolve(base, source, "defaults")

    _check_routes(head.routes, source, "routes")
    route_tables = {r: _check_layer(t, source, f"routes.{r}") for r, t in head.routes.items()}
    route_merged = {r: _merge(base, route_tables.get(r, {})) for r in ROUTES}
    route_rules = {r: _resolve(route_merged[r], source, f"routes.{r}", r) for r in ROUTES}

    model_rules: dict[tuple[str, str], CacheRule] = {}
    for model_id, table in head.models.items():
        mpath = f"models.{_toml_key(model_id)}"
        own = {k: v for k, v in table.items() if k != "routes"}
        _check_layer(own, source, mpath)
        per_route = table.get("routes", {})
        if not isinstance(per_route, Mapping):
            raise PolicyError(f"{source}: {mpath}.routes: expected a table of routes")
        _check_routes(per_route, source, f"{mpath}.routes")
        for r in ROUTES:
            top = per_route.get(r, {})
            rpath = f"{mpath}.routes.{r}"
            if not isinstance(top, Mapping):
                raise PolicyError(f"{source}: {rpath}: expected a table")
            _check_layer(top, source, rpath)
            merged = _merge(_merge(route_merged[r], own), top)
            model_rules[(model_id, r)] = _resolve(
                merged, source, rpath if r in per_route else mpath, r
            )

    share_groups = _share_groups(head, source)
    warnings = _check_sharing(head, source) + ((ADMIN_MOVED,) if head.admin is not None else ())
    rules = [("defaults", defaults), *((f"routes.{r}", x) for r, x in route_rules.items())]
    rules += [(f"models.{_toml_key(m)}.routes.{r}", x) for (m, r), x in model_rules.items()]
    try:
        guarded = guard_rules.check_guard(head.guard, _layers(head), rules)
    except guard_rules.GuardError as exc:
        raise PolicyError(f"{source}: {exc}") from None
    return Policy(
        source=source,
        tiers=head.tiers,
        admin=head.admin,
        defaults=defaults,
        route_rules=route_rules,
        model_rules=model_rules,
        share_groups=share_groups,
        warnings=warnings,
        guard=head.guard,
        guarded=guarded,
        logs_bodies=any(
            r.log_bodies for r in (defaults, *route_rules.values(), *model_rules.values())
        ),
    )


def load_policy(path: str | Path | None = None) -> Policy:
    """Load and validate a policy file (default: the embedded ``policies/default.toml``)."""
    p = Path(path) if path is not None else DEFAULT_POLICY
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(f"{p}: cannot read: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{p}: invalid TOML: {exc}") from None
    return parse_policy(data, str(p))


class PolicyHolder:
    """Holds the current policy snapshot; :meth:`reload` swaps it only when the new one is valid.

    Readers call :attr:`current` per request and keep that snapshot for the request's life.
    Tier settings are read once when the cache is built: a reload changes rules, not tiers.
    """

    def __init__(self, path: str | Path | None = None, policy: Policy | None = None) -> None:
        self.path: Path = Path(path) if path is not None else DEFAULT_POLICY
        self._current: Policy = policy if policy is not None else load_policy(self.path)
        _warn(self._current)

    @property
    def current(self) -> Policy:
        return self._current

    def reload(self) -> PolicyError | None:
        """Re-read the file. On error keep the old policy and return the error (never raises)."""
        try:
            new = load_policy(self.path)
        except PolicyError as exc:
            return exc
        self._current = new
        _warn(new)
        return None


def _warn(policy: Policy) -> None:
    for warning in policy.warnings:
        log.warning("policy %s: %s", policy.source, warning)
