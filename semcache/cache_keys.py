"""Cache keys: canonical request bytes, determinism, template fingerprints, versioned keys.

Two request bodies that mean the same thing give the same canonical bytes; any difference
that can change the answer gives different bytes. The rules, per OpenAI's and vLLM's request
schemas:

* Fields that cannot change the answer are dropped (``DROPPED_FIELDS``: ``model`` is a
  separate key part, ``stream``/``stream_options`` only change the framing, which replay
  handles, ``user``/``metadata``/``store``... are bookkeeping).
* ``null`` means "default" in these APIs, so top-level and message-level ``null`` are
  dropped, and a parameter equal to its documented default is dropped too (the same as
  filling defaults in, but shorter).
* A model's own generation defaults (what vLLM fills omitted fields with, from the
  checkpoint's ``generation_config.json``: ``sampling_defaults``) are filled in where the
  request leaves a field out, before that comparison: a request that omits ``temperature``
  and one that spells out the model's default share a key; one that spells out OpenAI's
  default does not, unless the model's default is OpenAI's.
* A Responses API request keeps ``stream`` in its bytes: its streamed and JSON answers are
  cached apart (an event stream is not rebuilt from a JSON answer).
* Aliases are unified: ``max_completion_tokens``/``max_tokens``; ``stop`` as a string or a
  list (order and duplicates do not matter); a one-element prompt/input list and a string;
  message content as a single text part and a string.
* Top-level and message keys are sorted and top-level numbers normalised (``1 == 1.0``).
  Values that the model *reads* — tool schemas, ``response_format``, guided-decoding schemas,
  message content — are kept byte-for-byte (order and number spelling included): they are
  rendered into the prompt or drive structured decoding, where ``1.0`` and ``1`` or a
  different property order can change the answer.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any, Final

import msgspec
import orjson

SHARED_SCOPE: Final = "shared"
TENANT_PREFIX: Final = "tenant:"
GROUP_PREFIX: Final = "group:"
KEY_VERSION: Final = b"semcache-exact-v1"

DROPPED_FIELDS: Final[frozenset[str]] = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        # vLLM scheduling/transport fields: same answer, different path to it.
        "priority",
        "request_id",
        "cache_salt",
        "kv_transfer_params",
    }
)

_SAMPLING: Final[dict[str, Any]] = {
    "temperature": 1,
    "top_p": 1,
    "n": 1,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    # vLLM extra sampling parameters
    "top_k": -1,
    "min_p": 0,
    "repetition_penalty": 1,
    "length_penalty": 1,
    "min_tokens": 0,
    "ignore_eos": False,
    "use_beam_search": False,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "stop_token_ids": [],
    "logit_bias": {},
}

ROUTE_DEFAULTS: Final[dict[str, dict[str, Any]]] = {
    "chat": {
        **_SAMPLING,
        "logprobs": False,
        "parallel_tool_calls": True,
        "response_format": {"type": "text"},
        "echo": False,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "add_special_tokens": False,
        "chat_template_kwargs": {},
    },
    "completions": {
        **_SAMPLING,
        "max_tokens": 16,
        "echo": False,
        "suffix": "",
        "add_special_tokens": True,
        "response_format": {"type": "text"},
    },
    "responses": {
        "temperature": 1,
        "top_p": 1,
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "top_k": -1,
        "min_p": 0,
        "repetition_penalty": 1,
        "ignore_eos": False,
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
        "stop_token_ids": [],
        "logit_bias": {},
        "background": False,
        "parallel_tool_calls": True,
        "tools": [],
        "top_logprobs": 0,
        "truncation": "disabled",
        "include_reasoning": True,
        "include": [],
    },
    "embeddings": {"encoding_format": "float"},
    "classification": {},
}

# The model's defaults each route takes for omitted fields (vLLM's request schemas): a
# completions request's omitted max_tokens is 16 whatever the model says; the Responses API
# names it max_output_tokens.
_MODEL_DEFAULTS: Final[dict[str, dict[str, str]]] = {
    "chat": {
        k: k
        for k in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "max_tokens",
        )
    },
}
_MODEL_DEFAULTS["completions"] = {
    k: v for k, v in _MODEL_DEFAULTS["chat"].items() if k != "max_tokens"
}
_MODEL_DEFAULTS["responses"] = {
    **_MODEL_DEFAULTS["completions"],
    "max_tokens": "max_output_tokens",
}

# Map-like parameters whose key order cannot matter (sorted like the top level).
_UNORDERED_MAPS: Final[frozenset[str]] = frozenset(
    {"logit_bias", "chat_template_kwargs", "mm_processor_kwargs"}
)
# Parameters that are sets of values.
_SET_PARAMS: Final[frozenset[str]] = frozenset({"stop", "stop_token_ids"})


_INT64: Final = 2.0**63


def _norm_number(v: Any) -> Any:
    """1.0 → 1, -0.0 → 0; bools and everything else unchanged.

    Only floats within 64 bits become ints: ``1e308`` stays a float, since the canonical
    bytes are written by orjson, which refuses wider integers.
    """
    if isinstance(v, float) and math.isfinite(v) and v.is_integer() and abs(v) < _INT64:
        return int(v)
    return v


def _same(a: Any, b: Any) -> bool:
    """Equality that does not confuse ``False`` with ``0`` or ``True`` with ``1``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return bool(a == b)


def _sorted_map(m: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _norm_number(m[k]) for k in sorted(m)}


def _single_text(v: Any) -> Any:
    """A one-element list of strings means the same as the string (one prompt/input)."""
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
        return v[0]
    return v


def _canon_message(msg: Any) -> Any:
    if not isinstance(msg, Mapping):
        return msg
    out: dict[str, Any] = {}
    for k in sorted(msg):
        v = msg[k]
        if v is None:
            continue
        if k == "content" and isinstance(v, list) and len(v) == 1:
            part = v[0]
            if (
                isinstance(part, Mapping)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
                and set(part) <= {"type", "text"}
            ):
                v = part["text"]
        if k == "tool_calls" and v == []:
            continue
        out[k] = v
    return out


def canonical_request(
    route: str,
    body: Mapping[str, Any],
    *,
    sampling_defaults: Mapping[str, Any] | None = None,
) -> bytes:
    """Canonical bytes of an OpenAI-style request body for ``route``.

    ``route`` is one of the policy's routes (chat, completions, responses, embeddings,
    classification, rerank, tokenize, detokenize); it is part of the bytes.
    ``sampling_defaults`` are the model's own defaults for omitted fields (for example the
    temperature from its ``generation_config.json``): filled in.
    """
    defaults = ROUTE_DEFAULTS.get(route, {})
    params: dict[str, Any] = {}
    for k, v in body.items():
        if k in DROPPED_FIELDS or v is None:
            continue
        params[k] = _norm_number(v)

    # Aliases.
    if "max_completion_tokens" in params:
        params["max_tokens"] = params.pop("max_completion_tokens")
    if sampling_defaults:
        for name, field in _MODEL_DEFAULTS.get(route, {}).items():
            value = sampling_defaults.get(name)
            if value is not None and field not in params:
                params[field] = _norm_number(value)
    for k in _SET_PARAMS:
        v = params.get(k)
        if isinstance(v, str):
            v = [v]
        if isinstance(v, list):
            if not v:
                del params[k]
                continue
            try:
                params[k] = sorted(set(v))
            except TypeError:  # unhashable or mixed: keep as given
                params[k] = v
    for k in ("prompt", "input"):
        if k in params:
            params[k] = _single_text(params[k])
    if isinstance(params.get("top_k"), int) and params["top_k"] == 0:
        params["top_k"] = -1  # vLLM: 0 and -1 both disable top-k
    if route == "chat":
        if "messages" in params and isinstance(params["messages"], list):
            params["messages"] = [_canon_message(m) for m in params["messages"]]
        # tool_choice defaults to "none" without tools and "auto" with them.
        tc_default = "auto" if params.get("tools") else "none"
        if params.get("tool_choice") == tc_default:
            del params["tool_choice"]
        if params.get("tools") == []:
            del params["tools"]
        if not params.get("logprobs") and "top_logprobs" in params:
            del params["top_logprobs"]  # ignored without logprobs
    if route == "responses":
        # A stored Responses stream is replayed as a stream only, a JSON answer as JSON only:
        # the two shapes are cached under different keys.
        params["stream"] = bool(body.get("stream"))
    if (
        route == "completions"
        and "best_of" in params
        and _same(params["best_of"], params.get("n", defaults.get("n", 1)))
    ):
        del params["best_of"]

    out: dict[str, Any] = {}
    for k in sorted(params):
        v = params[k]
        if k in defaults and _same(v, defaults[k]):
            continue
        if k in _UNORDERED_MAPS and isinstance(v, Mapping):
            v = _sorted_map(v)
        out[k] = v
    return orjson.dumps([route, out])


ALWAYS_DETERMINISTIC: Final = frozenset(
    {"embeddings", "classification", "rerank", "tokenize", "detokenize"}
)


def _temperature(route: str, body: Mapping[str, Any], defaults: Mapping[str, Any] | None) -> Any:
    t = body.get("temperature")
    if t is None and defaults:
        t = defaults.get("temperature")
    return 1 if t is None else t


def is_deterministic(
    route: str,
    body: Mapping[str, Any],
    *,
    sampling_defaults: Mapping[str, Any] | None = None,
) -> bool:
    """Whether repeating the request should give the same answer.

    Pooling (embeddings, classification, rerank scores) and tokenization always do;
    generation does with temperature 0, greedy ``top_k == 1``, or a fixed ``seed``.
    """
    if route in ALWAYS_DETERMINISTIC:
        return True
    if body.get("seed") is not None:
        return True
    t = _temperature(route, body, sampling_defaults)
    if isinstance(t, int | float) and not isinstance(t, bool) and t == 0:
        return True
    top_k = body.get("top_k")
    return isinstance(top_k, int) and not isinstance(top_k, bool) and top_k == 1


def _blake(*parts: bytes, size: int = 32) -> str:
    h = hashlib.blake2b(digest_size=size)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


def template_fingerprint(chat_template_fp: str, body: Mapping[str, Any]) -> str:
    """Fingerprint of the prompt template: the model's chat template and the system prompt(s).

    ``chat_template_fp`` comes from the model registry (a hash of the chat template; "" for
    models without one). System and developer messages of the request are included, so
    partitions (semantic index) and keys change when the system prompt does.
    """
    parts = [chat_template_fp.encode()]
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, Mapping) and m.get("role") in ("system", "developer"):
                content = _canon_message(m).get("content")
                parts.append(orjson.dumps([m["role"], content]))
    return _blake(*parts, size=8)


def params_hash(canonical: bytes) -> str:
    """Hash of canonical request bytes (see :func:`canonical_request`)."""
    return _blake(b"params", canonical)


def custom_params_hash(route: str, custom_key: str) -> str:
    """Hash for a caller-chosen key (``cf-aig-cache-key``), in place of the request's params."""
    return _blake(b"custom", route.encode(), custom_key.encode())


def scope_for(tenant: str | None, *, shared: bool) -> str:
    """The key scope: ``shared`` when the policy shares a model's answers, else the tenant."""
    if shared:
        return SHARED_SCOPE
    return f"{TENANT_PREFIX}{tenant or ''}"


def group_scope(name: str) -> str:
    """The key scope of a share group's members (``[share_groups.<name>]``)."""
    return f"{GROUP_PREFIX}{name}"


def is_tenant_scope(scope: str) -> bool:
    """A scope one tenant alone reads: what its cache headers say concerns no one else."""
    return scope.startswith(TENANT_PREFIX)


class CacheKey(msgspec.Struct, frozen=True, kw_only=True):
    """A versioned, scoped key. ``digest`` is computed from every other field."""

    scope: str
    """``tenant:<id>``, ``group:<name>`` or ``shared`` (see :func:`scope_for`,
    :func:`group_scope`)."""
    model_id: str
    revision: str
    """The model's revision from the registry: a new revision never serves old answers."""
    template_fp: str
    params_hash: str
    epochs: tuple[int, int, int] = (0, 0, 0)
    """Purge epochs (global, model, scope) when the key was built: a purge changes the key."""
    digest: str = ""

    def __post_init__(self) -> None:
        raw = msgspec.msgpack.encode(
            (
                self.scope,
                self.model_id,
                self.revision,
                self.template_fp,
                self.params_hash,
                self.epochs,
            )
        )
        msgspec.structs.force_setattr(self, "digest", _blake(KEY_VERSION, raw))

    @property
    def short_id(self) -> str:
        """First 12 hex characters of the digest, for a debug response header."""
        return self.digest[:12]

    @property
    def partition(self) -> tuple[str, str, str, str]:
        """The key parts minus the request text (semantic index partitions)."""
        return (self.scope, self.model_id, self.revision, self.template_fp)


def build_key(
    *,
    route: str,
    body: Mapping[str, Any],
    scope: str,
    model_id: str,
    revision: str,
    chat_template_fp: str = "",
    epochs: tuple[int, int, int] = (0, 0, 0),
    custom_key: str | None = None,
    sampling_defaults: Mapping[str, Any] | None = None,
) -> CacheKey:
    """Build the key of a request. With ``custom_key`` the body's params are replaced by it
    (same scope, model, revision and template)."""
    if custom_key is not None:
        # a Responses stream and JSON answer stay apart under one custom key too
        shape = ":stream" if route == "responses" and body.get("stream") else ""
        ph = custom_params_hash(route + shape, custom_key)
    else:
        ph = params_hash(canonical_request(route, body, sampling_defaults=sampling_defaults))
    return CacheKey(
        scope=scope,
        model_id=model_id,
        revision=revision,
        template_fp=template_fingerprint(chat_template_fp, body),
        params_hash=ph,
        epochs=epochs,
    )
