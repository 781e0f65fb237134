"""Data-loss prevention and guardrail rules of the policy file: their schema, validated once.

A rule layer's ``dlp`` table names entity types (or groups of them) per direction with an
action; its ``guardrails`` table names a classification model and, per direction, the
categories it scores with a threshold and an action::

    [defaults.dlp.prompt]
    CREDIT_CARD = "redact"
    CREDENTIALS = "block"          # a group: every credential type

    [routes.chat.guardrails]
    model = "safety"
    prompt = { unsafe = { threshold = 0.8, action = "block" } }

Layers merge table by table like every other field; ``[guard.tenants."<tenant>"]`` and
``[guard.keys."<key id>"]`` patch the merged rule last, for one tenant or API key.
``[guard.detectors.<NAME>]`` defines a custom entity type (regular expressions, a deny-list).
The detectors themselves run in ``server/guard``; this module only says what a rule means.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal, Protocol

import msgspec
import regex

from foundation.config_types import PosInt

Action = Literal["off", "flag", "redact", "block"]
"""``off`` (a layer turns an inherited entry off), ``flag`` (metric, log line, header: the
types, never the values), ``redact`` (a placeholder replaces the value), ``block`` (refused
in the route's error format; nothing reaches the backend or the caches)."""
RailAction = Literal["off", "flag", "block"]
"""A guardrail category's action (a score names no span to redact)."""
Direction = Literal["prompt", "answer"]
ACTION_RANK: Final = {"off": 0, "flag": 1, "redact": 2, "block": 3}

BUILTIN_GROUPS: Final[dict[str, tuple[str, ...]]] = {
    "FINANCIAL": ("CREDIT_CARD", "IBAN_CODE"),
    "NATIONAL_ID": (
        "US_SSN",
        "US_ITIN",
        "UK_NINO",
        "UK_NHS",
        "ES_NIF",
        "IT_FISCAL_CODE",
        "AU_TFN",
        "SG_NRIC_FIN",
    ),
    "CONTACT": ("EMAIL_ADDRESS", "PHONE_NUMBER", "IP_ADDRESS"),
    "CREDENTIALS": ("CLOUD_ACCESS_KEY", "API_TOKEN", "PRIVATE_KEY", "JWT"),
}
"""Groups a rule may name instead of each type (Cloudflare's DLP profiles are such groups);
an entry for one type of the group, in the same table, wins over the group's."""
BUILTIN_ENTITIES: Final[frozenset[str]] = frozenset(
    e for members in BUILTIN_GROUPS.values() for e in members
)


class Threshold(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A guardrail category: its score at or above ``threshold`` takes ``action``."""

    threshold: float = 0.5
    action: RailAction = "block"


class DlpRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What the detectors look for, per direction: entity type (or group) → action."""

    prompt: dict[str, Action] = msgspec.field(default_factory=dict)
    answer: dict[str, Action] = msgspec.field(default_factory=dict)


class GuardrailRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A classification model scoring the prompt and/or the answer, per category."""

    model: str | None = None
    """A gateway model id (or alias) whose task is ``classification``."""
    prompt: dict[str, Threshold] = msgspec.field(default_factory=dict)
    answer: dict[str, Threshold] = msgspec.field(default_factory=dict)


class CustomDetector(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """An entity type of the operator's: regular expressions and/or a deny-list."""

    patterns: tuple[str, ...] = ()
    """Regular expressions (the ``regex`` module's syntax, case-insensitive)."""
    deny_list: tuple[str, ...] = ()
    """Words or phrases matched whole, case-insensitively."""
    context: tuple[str, ...] = ()
    """Words that, near a match, raise its score (Presidio's context enhancement)."""
    score: float = 0.85


class GuardSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[guard]``: custom detectors, the stream window, per-tenant and per-key patches."""

    min_score: float = 0.5
    """Findings scored below this are ignored (Presidio scores 0 to 1)."""
    hold_back_chars: PosInt = 128
    """A streamed answer's text is held back this many characters, so a value split across
    chunks is seen whole before it leaves; also the longest value caught across chunks."""
    detectors: dict[str, CustomDetector] = msgspec.field(default_factory=dict)
    tenants: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    keys: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)


class GuardRule(msgspec.Struct, frozen=True, kw_only=True):
    """What applies to one request: entity → action per direction (groups expanded,
    ``off`` dropped), the guardrail, and the version the cache keys carry."""

    prompt: dict[str, Action]
    answer: dict[str, Action]
    guardrails: GuardrailRule
    version: str
    """A digest of everything above and the detectors it uses: part of the cache key."""

    @property
    def active(self) -> bool:
        g = self.guardrails
        return bool(self.prompt or self.answer or (g.model and (g.prompt or g.answer)))


class _GuardPatch(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    dlp: DlpRule | msgspec.UnsetType = msgspec.UNSET
    guardrails: GuardrailRule | msgspec.UnsetType = msgspec.UNSET


class GuardError(ValueError):
    """A guard table is invalid: ``path`` and what was expected."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


def check_detectors(settings: GuardSettings) -> None:
    """Every custom detector compiles and says what to look for."""
    for name, det in settings.detectors.items():
        path = f"guard.detectors.{name}"
        if name in BUILTIN_ENTITIES or name in BUILTIN_GROUPS:
            raise GuardError(path, "names a built-in entity type or group; choose another name")
        if not name.replace("_", "").isalnum() or not name.isupper():
            raise GuardError(path, "expected an upper-case name (A-Z, 0-9, _)")
        if not det.patterns and not det.deny_list:
            raise GuardError(path, "expected `patterns` or `deny_list`")
        for i, pattern in enumerate(det.patterns):
            try:
                regex.compile(pattern, regex.IGNORECASE)
            except regex.error as exc:
                raise GuardError(f"{path}.patterns[{i}]", f"invalid regex: {exc}") from None
        for i, word in enumerate(det.deny_list):
            if not word.strip():
                raise GuardError(f"{path}.deny_list[{i}]", "an empty entry")


def known_entities(settings: GuardSettings) -> frozenset[str]:
    return BUILTIN_ENTITIES | frozenset(settings.detectors)


def check_tables(dlp: DlpRule, guardrails: GuardrailRule, path: str, known: frozenset[str]) -> None:
    """Entity names are known types or groups; thresholds lie in [0, 1]."""
    for direction in ("prompt", "answer"):
        for name in getattr(dlp, direction):
            if name not in known and name not in BUILTIN_GROUPS:
                raise GuardError(
                    f"{path}.dlp.{direction}.{name}",
                    "unknown entity type; expected a group ("
                    + ", ".join(sorted(BUILTIN_GROUPS))
                    + "), a type ("
                    + ", ".join(sorted(known))
                    + ") or a [guard.detectors] name",
                )
        for category, th in getattr(guardrails, direction).items():
            if not 0.0 <= th.threshold <= 1.0:
                raise GuardError(
                    f"{path}.guardrails.{direction}.{category}.threshold",
                    f"{th.threshold} is not a score; expected 0 <= threshold <= 1",
                )


def check_rails_model(guardrails: GuardrailRule, path: str) -> None:
    """A merged rule that scores categories names the model that scores them."""
    if (guardrails.prompt or guardrails.answer) and not guardrails.model:
        raise GuardError(
            f"{path}.guardrails.model", "missing; expected a classification model's id"
        )


def check_patches(settings: GuardSettings, known: frozenset[str]) -> None:
    for kind, patches in (("tenants", settings.tenants), ("keys", settings.keys)):
        for who, table in patches.items():
            path = f"guard.{kind}.{who}"
            try:
                patch = msgspec.convert(table, _GuardPatch)
            except msgspec.ValidationError as exc:
                raise GuardError(path, str(exc)) from None
            dlp = patch.dlp if isinstance(patch.dlp, DlpRule) else DlpRule()
            rails = patch.guardrails if isinstance(patch.guardrails, GuardrailRule) else None
            check_tables(dlp, rails or GuardrailRule(), path, known)


def _expand(table: Mapping[str, Action]) -> dict[str, Action]:
    """Groups expanded (a type named in the same table wins), ``off`` entries dropped."""
    out: dict[str, Action] = {}
    for name, action in table.items():
        for member in BUILTIN_GROUPS.get(name, ()):
            out.setdefault(member, action)
    for name, action in table.items():
        if name not in BUILTIN_GROUPS:
            out[name] = action
    return {k: v for k, v in sorted(out.items()) if v != "off"}


def _patched(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in patch.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _patched(out[k], v)
        else:
            out[k] = v
    return out


def resolve_guard(
    dlp: DlpRule,
    guardrails: GuardrailRule,
    settings: GuardSettings,
    patches: tuple[Mapping[str, Any], ...] = (),
) -> GuardRule:
    """The rule of a request: the merged layers' tables, then each patch (tenant, key)."""
    tables: dict[str, Any] = {
        "dlp": msgspec.to_builtins(dlp),
        "guardrails": msgspec.to_builtins(guardrails),
    }
    for patch in patches:
        tables = _patched(tables, patch)
    dlp = msgspec.convert(tables["dlp"], DlpRule)
    rails = msgspec.convert(tables["guardrails"], GuardrailRule)
    prompt, answer = _expand(dlp.prompt), _expand(dlp.answer)
    used = sorted(set(prompt) | set(answer))
    digest = hashlib.blake2b(digest_size=8)
    digest.update(
        msgspec.json.encode(
            [
                prompt,
                answer,
                rails,
                settings.min_score,
                settings.hold_back_chars,
                {n: settings.detectors[n] for n in used if n in settings.detectors},
            ]
        )
    )
    return GuardRule(prompt=prompt, answer=answer, guardrails=rails, version=digest.hexdigest())


class _Tables(Protocol):
    @property
    def dlp(self) -> DlpRule: ...

    @property
    def guardrails(self) -> GuardrailRule: ...


def for_request(
    settings: GuardSettings,
    memo: dict[Any, GuardRule],
    rule: _Tables,
    tenant: str | None,
    token: str | None,
) -> GuardRule:
    """A merged rule's guard, patched by the tenant's and the key's tables (memoised)."""
    at = (id(rule), tenant, token)
    found = memo.get(at)
    if found is None:
        patches = tuple(
            p
            for p in (settings.tenants.get(tenant or ""), settings.keys.get(token or ""))
            if p is not None
        )
        found = resolve_guard(rule.dlp, rule.guardrails, settings, patches)
        if len(memo) < 100_000:
            memo[at] = found
    return found


def check_guard(
    settings: GuardSettings,
    layers: Sequence[tuple[str, Mapping[str, Any]]],
    merged: Sequence[tuple[str, _Tables]],
) -> bool:
    """The ``dlp`` and ``guardrails`` tables of every layer (``layers``: path and raw table)
    and ``[guard]``: known entity types, detectors that compile, a model wherever categories
    are scored (``merged``: path and merged rule). Whether anything is inspected at all."""
    known = known_entities(settings)
    check_detectors(settings)
    for path, table in layers:
        try:
            dlp = msgspec.convert(table.get("dlp", {}), DlpRule)
            rails = msgspec.convert(table.get("guardrails", {}), GuardrailRule)
        except msgspec.ValidationError as exc:
            raise GuardError(path, str(exc)) from None
        check_tables(dlp, rails, path, known)
    for path, rule in merged:
        check_rails_model(rule.guardrails, path)
    check_patches(settings, known)
    return bool(settings.tenants or settings.keys) or any(
        resolve_guard(r.dlp, r.guardrails, settings).active for _, r in merged
    )


NO_GUARD: Final = GuardRule(prompt={}, answer={}, guardrails=GuardrailRule(), version="")
