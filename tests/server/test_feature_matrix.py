"""Pairwise combinations of the gateway's features through `semcache serve` on the embedded
default (real SmolLM2 on a vLLM prefill/decode pair, MiniLM, the sentiment classifier).

Each case is one surface with one choice of every other feature (stream, max_tokens, cache
directive, DLP rule, identity, tools, prompt length), in a tenant of its own; the invariants
of :func:`test_feature_combination` hold for every case. An open gateway cannot also know
config tokens (listing one closes it), so the open identity's cases go to a second gateway
(`--no-launch`) in front of the same vLLM pair.
"""

from __future__ import annotations

import hashlib
import json
import random
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import combinations, product
from pathlib import Path
from typing import Any

import httpx
import pytest
from allpairspy import AllPairs
from prometheus_client.parser import text_string_to_metric_families

from backends.config import VllmBackendConfig
from harness.gateway import GatewayProcess
from harness.metrics import parse_metric
from semcache.policy import DEFAULT_POLICY
from server.config import DEFAULT_CONFIG, parse_config
from tests.support.configs import write_default_config, write_policy
from tests.support.dlp_values import card
from tests.support.waiting import wait_until

MODEL = "SmolLM2-135M-Instruct"
ADMIN = "matrix-admin"
ACCOUNT = "acc-matrix"

SURFACES = (
    "chat",
    "completions",
    "responses",
    "messages",
    "wai_text",
    "wai_embeddings",
    "wai_classify",
    "embeddings",
)
GENERATION = frozenset({"chat", "completions", "responses", "messages", "wai_text"})
SEMANTIC = frozenset(
    {"chat", "messages", "wai_text", "wai_embeddings", "wai_classify", "embeddings"}
)
"""Surfaces a semantic rule of the matrix's policy covers (chat route; embeddings and
classification items)."""
TOOLS = frozenset({"chat", "messages"})
WORKERS_AI = frozenset({"wai_text", "wai_embeddings", "wai_classify"})

DIMENSIONS = {
    "surface": SURFACES,
    "stream": (False, True),
    "max_tokens": ("set", "absent", "over_cap"),
    "cache": ("exact", "semantic", "bypass", "no_store"),
    "dlp": ("none", "flag", "redact"),
    "identity": ("open", "config", "key"),
    "tools": (False, True),
    "prompt": ("short", "long"),
}
NAMES = tuple(DIMENSIONS)

MAX_TOKENS_SET, MAX_TOKENS_DEFAULT, MAX_TOKENS_CAP, MAX_TOKENS_OVER = 6, 8, 10, 40
"""What a case sends (set), the policy's default (absent), its cap, and what an over-cap
case asks for: small, so a case's misses take little time."""


def possible(values: list[Any]) -> bool:
    """Whether a (partial) row of values, in ``NAMES`` order, can be a request."""
    row = dict(zip(NAMES, values, strict=False))
    surface = row.get("surface")
    if surface is None:
        return True
    if row.get("stream") and surface not in GENERATION:
        return False  # pooling answers do not stream
    if surface not in GENERATION and row.get("max_tokens", "absent") != "absent":
        return False  # no answer length to set
    if surface == "messages" and row.get("max_tokens") == "absent":
        return False  # Anthropic's Messages API requires max_tokens
    if row.get("cache") == "semantic" and surface not in SEMANTIC:
        return False  # no semantic rule covers completions or responses
    return not (row.get("tools") and surface not in TOOLS)


@dataclass(frozen=True)
class Case:
    surface: str
    stream: bool
    max_tokens: str
    cache: str
    dlp: str
    identity: str
    tools: bool
    prompt: str

    @property
    def id(self) -> str:
        parts = [self.surface, "stream" if self.stream else "", f"mt-{self.max_tokens}"]
        parts += [self.cache, f"dlp-{self.dlp}", self.identity, "tools" if self.tools else ""]
        return "-".join(p for p in [*parts, self.prompt] if p)

    @property
    def tenant(self) -> str:
        return f"mx-{self.id}"

    @property
    def other_tenant(self) -> str:
        return f"mx-{self.id}-other"


def pairs_of(row: tuple[Any, ...]) -> set[tuple[int, Any, int, Any]]:
    """Each pair of (dimension, value) in ``row``."""
    return {(i, row[i], j, row[j]) for i, j in combinations(range(len(row)), 2)}


def pairwise_rows() -> list[tuple[Any, ...]]:
    """``AllPairs`` under :func:`possible`, completed: its filter can leave a possible pair
    out, so each one missing adds the possible row that covers most of those still missing."""
    rows = [tuple(row) for row in AllPairs(list(DIMENSIONS.values()), filter_func=possible)]
    every = [row for row in product(*DIMENSIONS.values()) if possible(list(row))]
    missing = set().union(*map(pairs_of, every)) - set().union(*map(pairs_of, rows))
    while missing:
        pair = min(missing, key=repr)
        best = max(
            (row for row in every if pair in pairs_of(row)),
            key=lambda row: len(pairs_of(row) & missing),
        )
        rows.append(best)
        missing -= pairs_of(best)
    return rows


CASES = [Case(*row) for row in pairwise_rows()]


def open_tenant(token: str) -> str:
    """An open gateway's tenant of a bearer token (``server.identity.auth.tenant_from``)."""
    return "key:" + hashlib.blake2b(token.encode(), digest_size=8).hexdigest()


def config_token(tenant: str) -> str:
    return f"tok-{tenant}"


def open_token(tenant: str) -> str:
    return f"open-{tenant}"


RATE_LIMITS = {"requests_per_minute": 100_000, "tokens_per_minute": 10_000_000}


def gateway_extra(cases: list[Case]) -> str:
    """What the matrix appends to the shipped config: the admin token, a config token per
    config-identity tenant, rate windows for every token, and the request log's tenant
    metric."""
    lines = ["", "[limits]"]
    lines += [f"{name} = {value}" for name, value in RATE_LIMITS.items()]
    lines += ["hits_spend_tokens = false", "", "[request_log]", "tenant_metrics = true"]
    lines += ["stdout = true", "", "[auth.admin]", f'token = "{ADMIN}"', ""]
    for case in cases:
        if case.identity != "config":
            continue
        for tenant in (case.tenant, case.other_tenant):
            lines += ["[[auth.tokens]]", f'token = "{config_token(tenant)}"']
            lines += [f'tenant = "{tenant}"', f'name = "{tenant}"', ""]
    return "\n".join(lines)


def dlp_scope(case: Case, tenant: str) -> str:
    """The policy table a case's DLP rule patches for one of its tenants: its config token's
    name (per key), or its tenant (an API key's, an open gateway's)."""
    if case.identity == "config":
        return f'guard.keys."{tenant}"'
    if case.identity == "open":
        tenant = open_tenant(open_token(tenant))
    return f'guard.tenants."{tenant}"'


def matrix_policy(cases: list[Case]) -> str:
    """The shipped default policy plus what the matrix needs: a chat semantic rule for
    SmolLM2, a small default and cap of its answers, and each case's DLP rule."""
    lines = [DEFAULT_POLICY.read_text()]
    lines += [
        f'[models."{MODEL}".routes.chat.semantic]',
        "enabled = true",
        "threshold = 0.9",
        "",
        f'[models."{MODEL}".max_tokens]',
        f"default = {MAX_TOKENS_DEFAULT}",
        f"cap = {MAX_TOKENS_CAP}",
        "",
    ]
    rules = {"flag": 'EMAIL_ADDRESS = "flag"', "redact": 'CREDIT_CARD = "redact"'}
    for case in cases:  # the other tenant too: its identical request must redact as well
        for tenant in (case.tenant, case.other_tenant) if case.dlp in rules else ():
            lines += [f"[{dlp_scope(case, tenant)}.dlp.prompt]", rules[case.dlp], ""]
    return "\n".join(lines)


@dataclass
class Matrix:
    """The two gateways and what the cases need to reach them."""

    closed: GatewayProcess
    """``semcache serve`` with the vLLM pair it launched, config tokens and API keys."""
    open: GatewayProcess
    """An open gateway (`--no-launch`) in front of the same vLLM pair."""
    data_dirs: tuple[Path, Path]
    card: str
    """The credit card number the redact cases send (fresh per run)."""
    keys: dict[str, str] = field(default_factory=dict)
    """API key secrets by tenant, made through the admin API."""


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Iterator[Matrix]:
    root = tmp_path_factory.mktemp("matrix")
    dirs = (root / "closed", root / "open")
    for folder in dirs:  # the converted model once for every run; caches of this run
        folder.mkdir()
        (data_dir / "models").mkdir(exist_ok=True)
        (folder / "models").symlink_to(data_dir / "models")
    policy = write_policy(root, matrix_policy(CASES))
    extra = gateway_extra(CASES)
    closed_path, _ = write_default_config(root, dirs[0], extra, "closed.toml")
    open_text = closed_path.read_text().replace(
        f'data_dir = "{dirs[0]}"', f'data_dir = "{dirs[1]}"'
    )
    open_text = open_text.split("\n[[auth.tokens]]")[0]
    (root / "open.toml").write_text(open_text)
    args = ("--policy", str(policy))
    closed = GatewayProcess(closed_path, launch=True, args=args)
    opened = GatewayProcess(root / "open.toml", args=args)
    try:
        closed.start(600)
        closed.wait_answers("/ready", 300)
        opened.start(300)
        opened.wait_answers("/ready", 120)
        yield Matrix(closed, opened, dirs, card(random.Random()))
    finally:
        opened.stop(30)
        closed.stop(60)


# -- the requests -------------------------------------------------------------------------

(SMOLLM2,) = [
    b
    for b in parse_config(tomllib.loads(DEFAULT_CONFIG.read_text())).backends
    if isinstance(b, VllmBackendConfig)
]
PREFILL_THRESHOLD = SMOLLM2.prefill_threshold_tokens
"""The embedded default's threshold: a prompt missing this many tokens on the decode server
takes the prefill hop."""
SHORT = "What is the capital of France?"
LONG = "A bird visits the old tree every day and sings to the morning sun. " * 24
"""Over the prefill threshold of the default config (256 tokens the decode server lacks)."""
POSITIVE = "I absolutely love this wonderful film, it is fantastic and moving!"
NEW_ITEM = "Whales sing long songs in the deep cold ocean."
EMAIL = "jane.doe@example.com"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
WEATHER_ANTHROPIC = {
    "name": "get_weather",
    "description": "Get the current weather of a city.",
    "input_schema": WEATHER["function"]["parameters"],  # type: ignore[index]
}

PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
    "embeddings": "/v1/embeddings",
    "wai_text": f"/client/v4/accounts/{ACCOUNT}/ai/run/@cf/huggingface/smollm2-135m-instruct",
    "wai_embeddings": f"/client/v4/accounts/{ACCOUNT}/ai/run/@cf/baai/bge-small-en-v1.5",
    "wai_classify": f"/client/v4/accounts/{ACCOUNT}/ai/run/@cf/huggingface/distilbert-sst-2-int8",
}
MAX_TOKENS_FIELD = {
    "chat": "max_tokens",
    "completions": "max_tokens",
    "responses": "max_output_tokens",
    "messages": "max_tokens",
    "wai_text": "max_tokens",
}


def texts(case: Case, secret: str) -> list[str]:
    """The case's input texts: one prompt, or two items (embeddings), with the sensitive
    value its DLP rule looks for."""
    base = POSITIVE if case.surface == "wai_classify" else SHORT
    if case.prompt == "long":
        base = f"{LONG}{base}"
    if case.dlp == "flag":
        base = f"My email is {EMAIL}. {base}"
    elif case.dlp == "redact":
        base = f"My card is {secret}. {base}"
    if case.surface in ("embeddings", "wai_embeddings"):
        return [base, f"Second item. {base}"]
    return [base]


def near(text: str) -> str:
    """A near-duplicate: the same words in another case (MiniLM is uncased: cosine 1)."""
    return text.swapcase()


def request_body(case: Case, items: list[str]) -> dict[str, Any]:
    surface = case.surface
    if surface == "embeddings":
        return {"model": "all-MiniLM-L6-v2", "input": items}
    if surface == "wai_embeddings":
        return {"text": items}
    if surface == "wai_classify":
        return {"text": items[0]}
    (prompt,) = items
    messages = [{"role": "user", "content": prompt}]
    body: dict[str, Any]
    if surface == "chat":
        body = {"model": MODEL, "messages": messages}
        if case.stream:
            body["stream_options"] = {"include_usage": True}
    elif surface == "completions":
        body = {"model": MODEL, "prompt": prompt}
        if case.stream:
            body["stream_options"] = {"include_usage": True}
    elif surface == "responses":
        body = {"model": MODEL, "input": prompt, "store": False}
    elif surface == "messages":
        body = {"model": MODEL, "messages": messages}
    else:
        body = {"messages": messages}
    body["temperature"] = 0
    if case.stream:
        body["stream"] = True
    if case.tools:
        body["tools"] = [WEATHER_ANTHROPIC if surface == "messages" else WEATHER]
    limit = {"set": MAX_TOKENS_SET, "over_cap": MAX_TOKENS_OVER}.get(case.max_tokens)
    if limit is not None:
        body[MAX_TOKENS_FIELD[surface]] = limit
    return body


def directive(case: Case) -> dict[str, str]:
    """The cache directive of a bypass or no-store case's request."""
    if case.cache == "bypass":
        if case.surface in WORKERS_AI:
            return {"cf-aig-skip-cache": "true"}
        return {"cache-control": "no-cache"}
    if case.cache == "no_store":
        return {"cache-control": "no-store"}
    return {}


@dataclass
class Answer:
    """One answer as the client read it."""

    status: int
    headers: httpx.Headers
    body: bytes
    content: Any
    """What a replay must repeat: (text, tool calls, finish reason), vectors or labels."""
    usage: dict[str, Any]

    @property
    def outcome(self) -> str:
        """What the headers state: miss, exact, semantic, partial or bypass."""
        semantic = self.headers.get("x-semcache-semantic")
        if semantic in ("hit", "partial"):
            return "semantic" if semantic == "hit" else "partial"
        status = self.headers.get("cf-aig-cache-status", "")
        return {"HIT": "exact", "MISS": "miss", "BYPASS": "bypass"}[status]

    @property
    def stored(self) -> bool:
        return "stored" in self.headers.get("cache-status", "")

    @property
    def saved(self) -> int:
        return int(self.headers.get("x-semcache-saved-tokens", "0"))

    @property
    def tokens(self) -> int:
        """The tokens the client was told it used."""
        usage = self.usage
        prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0))
        for cached in ("cache_read_input_tokens", "cache_creation_input_tokens"):  # Anthropic's
            prompt += usage.get(cached) or 0
        return int(prompt) + int(usage.get("completion_tokens", usage.get("output_tokens", 0)))


def sse_events(body: bytes) -> list[tuple[str | None, Any]]:
    """(event name, decoded data) of each event of a server-sent stream ([DONE] left out)."""
    events = []
    for block in body.decode().split("\n\n"):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if data and data != ["[DONE]"]:
            events.append((name, json.loads("\n".join(data))))
    return events


def read_answer(case: Case, response: httpx.Response) -> Answer:
    body = response.content
    args = (response.status_code, response.headers, body)
    assert response.status_code == 200, body[:500]
    surface = case.surface
    if surface in ("embeddings", "wai_embeddings", "wai_classify"):
        data = response.json()
        if surface == "embeddings":
            return Answer(*args, [d["embedding"] for d in data["data"]], data["usage"])
        result = data["result"]
        if surface == "wai_classify":
            return Answer(*args, result, {})
        return Answer(*args, result["data"], result.get("usage") or {})
    if not case.stream:
        return Answer(*args, *_whole(surface, response.json()))
    return Answer(*args, *_streamed(surface, sse_events(body)))


def _whole(surface: str, data: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    if surface == "chat":
        choice = data["choices"][0]
        message = choice["message"]
        calls = [
            (c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls") or []
        ]
        return (message.get("content") or "", calls, choice["finish_reason"]), data["usage"]
    if surface == "completions":
        choice = data["choices"][0]
        return (choice["text"], [], choice["finish_reason"]), data["usage"]
    if surface == "responses":
        text = "".join(
            part.get("text", "")
            for item in data["output"]
            if item.get("type") == "message"
            for part in item["content"]
        )
        return (text, [], data["status"]), data["usage"]
    if surface == "messages":
        text = "".join(b.get("text", "") for b in data["content"] if b["type"] == "text")
        calls = [
            (b["name"], json.dumps(b["input"])) for b in data["content"] if b["type"] == "tool_use"
        ]
        return (text, calls, data["stop_reason"]), data["usage"]
    result = data["result"]
    calls = [(c["name"], json.dumps(c["arguments"])) for c in result.get("tool_calls") or []]
    return (result["response"], calls, None), result["usage"]


def _streamed(surface: str, events: list[tuple[str | None, Any]]) -> tuple[Any, dict[str, Any]]:
    text, finish, usage = "", None, {}
    calls: dict[int, list[str]] = {}
    for name, data in events:
        if surface in ("chat", "completions"):
            usage = data.get("usage") or usage
            for choice in data.get("choices") or []:
                delta = choice.get("delta", {})
                text += delta.get("content") or choice.get("text") or ""
                for call in delta.get("tool_calls") or []:
                    got = calls.setdefault(call["index"], ["", ""])
                    got[0] += call.get("function", {}).get("name") or ""
                    got[1] += call.get("function", {}).get("arguments") or ""
                finish = choice.get("finish_reason") or finish
        elif surface == "responses":
            if name == "response.output_text.delta":
                text += data["delta"]
            elif name in ("response.completed", "response.incomplete"):
                finish, usage = data["response"]["status"], data["response"]["usage"]
        elif surface == "messages":
            if name == "content_block_start" and data["content_block"]["type"] == "tool_use":
                calls[data["index"]] = [data["content_block"]["name"], ""]
            elif name == "content_block_delta":
                delta = data["delta"]
                if delta["type"] == "text_delta":
                    text += delta["text"]
                elif delta["type"] == "input_json_delta":
                    calls[data["index"]][1] += delta["partial_json"]
            elif name == "message_delta":
                finish = data["delta"]["stop_reason"]
                usage = {**usage, **data["usage"]}
            elif name == "message_start":
                usage = data["message"]["usage"]
        else:
            text += data.get("response") or ""
            usage = data.get("usage") or usage
            for i, call in enumerate(data.get("tool_calls") or []):
                calls[i] = [call["name"], json.dumps(call["arguments"])]
    return (text, [tuple(calls[i]) for i in sorted(calls)], finish), usage


# -- one case -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Caller:
    """Who sends a case's requests: the gateway, the bearer token, the tenant it counts as."""

    gateway: GatewayProcess
    token: str
    tenant: str

    def get(self, path: str, **params: str) -> Any:
        response = httpx.get(
            self.gateway.url + path, params=params, headers={"authorization": f"Bearer {ADMIN}"}
        )
        assert response.status_code == 200, response.text
        return response.json()


def caller(matrix: Matrix, case: Case, tenant: str) -> Caller:
    if case.identity == "open":
        token = open_token(tenant)
        return Caller(matrix.open, token, open_tenant(token))
    if case.identity == "config":
        return Caller(matrix.closed, config_token(tenant), tenant)
    if tenant not in matrix.keys:
        made = httpx.post(
            f"{matrix.closed.url}/admin/keys",
            json={"tenant": tenant, "name": tenant},
            headers={"authorization": f"Bearer {ADMIN}"},
        )
        assert made.status_code == 200, made.text
        matrix.keys[tenant] = made.json()["secret"]
    return Caller(matrix.closed, matrix.keys[tenant], tenant)


@dataclass(frozen=True)
class Step:
    """One request of a case and what its headers must state."""

    name: str
    items: list[str]
    headers: dict[str, str]
    outcome: str
    stored: bool = False
    replays: str | None = None
    """The step whose stored answer this one must repeat."""
    other: bool = False
    """Sent by the other tenant."""


def plan(case: Case, secret: str) -> list[Step]:
    first = texts(case, secret)
    steps = [Step("first", first, directive(case), "miss", stored=True)]
    if case.cache in ("exact", "semantic"):
        steps.append(Step("repeat", first, {}, "exact", replays="first"))
    if case.cache == "semantic":
        steps.append(Step("near", [near(t) for t in first], {}, "semantic", replays="first"))
        if case.surface in ("embeddings", "wai_embeddings"):
            steps.append(Step("partial", [near(first[0]), NEW_ITEM], {}, "partial", stored=True))
    elif case.cache == "bypass":
        skip = "cf-aig-skip-cache" in directive(case)  # neither read nor store
        steps[0] = Step("first", first, directive(case), "bypass", stored=not skip)
        steps.append(Step("repeat", first, directive(case), "bypass", stored=not skip))
        if skip:
            steps.append(Step("plain", first, {}, "miss", stored=True))
        else:  # no-cache: stored all the same
            steps.append(Step("plain", first, {}, "exact", replays="repeat"))
    elif case.cache == "no_store":
        steps[0] = Step("first", first, directive(case), "miss")
        steps.append(Step("repeat", first, directive(case), "miss"))
        steps.append(Step("plain", first, {}, "miss", stored=True))
        steps.append(Step("again", first, {}, "exact", replays="plain"))
    steps.append(Step("other", first, {}, "miss", stored=True, other=True))
    return steps


def send(case: Case, who: Caller, step: Step) -> Answer:
    """The step's request as its tenant sends it, and the answer as the client reads it."""
    body = json.dumps(request_body(case, step.items)).encode()
    headers = {
        "authorization": f"Bearer {who.token}",
        "content-type": "application/json",
        **step.headers,
    }
    response = httpx.post(
        who.gateway.url + PATHS[case.surface], content=body, headers=headers, timeout=120
    )
    return read_answer(case, response)


OUTCOMES = ("miss", "exact", "semantic", "partial", "bypass")
"""What a step's headers state, named as the request log and the metrics name it."""
HITS = ("exact", "semantic")


def test_the_cases_hold_every_possible_pair_and_nothing_impossible() -> None:
    every = [row for row in product(*DIMENSIONS.values()) if possible(list(row))]
    rows = [tuple(vars(case).values()) for case in CASES]
    assert all(possible(list(row)) for row in rows)
    assert set().union(*map(pairs_of, rows)) == set().union(*map(pairs_of, every))
    assert len(rows) < len(every) / 50  # pairwise, not every combination


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_feature_combination(matrix: Matrix, case: Case) -> None:
    """Every step states the outcome its case expects, and the request log, the ledger, the
    rate windows and the metrics count that outcome; no redacted value leaves the gateway."""
    steps = plan(case, matrix.card)
    mine, theirs = caller(matrix, case, case.tenant), caller(matrix, case, case.other_tenant)
    before = httpx.get(f"{mine.gateway.url}/metrics").text
    answers: dict[str, Answer] = {}
    for step in steps:
        answer = send(case, theirs if step.other else mine, step)
        answers[step.name] = answer
        check_answer(case, step, answer, answers, matrix.card)
    after = httpx.get(f"{mine.gateway.url}/metrics").text
    for who, own in (
        (mine, [s for s in steps if not s.other]),
        (theirs, [s for s in steps if s.other]),
    ):
        lines = check_log(case, who, own, answers, matrix.card)
        check_ledger(who, own, answers, lines)
        check_limits(who, len(own), lines)
        check_tenant_metric(who, len(own), after)
    check_cache_metrics(steps, before, after)
    if case.dlp == "redact":
        check_nothing_holds(matrix, mine.gateway, matrix.card)


def secret_forms(secret: str) -> list[str]:
    return [secret, secret.replace(" ", "")]


def check_answer(
    case: Case, step: Step, answer: Answer, answers: dict[str, Answer], secret: str
) -> None:
    where = f"{step.name}: {dict(answer.headers)}"
    assert answer.outcome == step.outcome, where
    streamed = answer.headers["content-type"].startswith("text/event-stream")
    assert streamed is case.stream, where  # a hit of a stream replays a stream
    if step.outcome in ("miss", "partial", "bypass") and not case.stream:
        assert answer.stored == step.stored, where
    if step.replays is not None:
        assert answer.content == answers[step.replays].content, where
    if step.outcome in HITS:  # a classification answer has no usage to compare with
        assert answer.saved == (answer.tokens if answer.usage else answer.saved) > 0, where
    elif step.outcome == "partial":
        assert 0 < answer.saved < answer.tokens, where
    else:
        assert answer.saved == 0, where
    if case.dlp == "flag":
        assert "EMAIL_ADDRESS" in answer.headers.get("x-semcache-dlp-prompt", ""), where
    for form in secret_forms(secret):
        assert form.encode() not in answer.body
    if case.surface in GENERATION and case.surface != "messages":
        applied = {
            "absent": {"max_tokens_applied": MAX_TOKENS_DEFAULT, "max_tokens_source": "default"},
            "over_cap": {"max_tokens_applied": MAX_TOKENS_CAP, "max_tokens_source": "cap"},
        }.get(case.max_tokens, {})
        note = {
            k: answer.usage[k]
            for k in ("max_tokens_applied", "max_tokens_source")
            if k in answer.usage
        }
        assert note == applied, where
    if case.surface in GENERATION:
        bound = {"set": MAX_TOKENS_SET, "absent": MAX_TOKENS_DEFAULT}.get(
            case.max_tokens, MAX_TOKENS_CAP
        )
        completion = answer.usage.get("completion_tokens", answer.usage.get("output_tokens"))
        assert 0 < completion <= bound, where


def logged(who: Caller, count: int) -> list[dict[str, Any]]:
    """The tenant's request log lines of its ``count`` model requests, oldest first."""
    found: list[dict[str, Any]] = []

    def complete() -> bool:
        nonlocal found
        data = who.get("/admin/logs", tenant=who.tenant, limit="200")["data"]
        found = [line for line in reversed(data) if line["model"] not in (None, "-")]
        return len(found) >= count

    wait_until(complete, timeout_s=10)
    assert len(found) == count, found
    return found


def check_log(
    case: Case, who: Caller, steps: list[Step], answers: dict[str, Answer], secret: str
) -> list[dict[str, Any]]:
    lines = logged(who, len(steps))
    for step, line in zip(steps, lines, strict=True):
        answer, where = answers[step.name], f"{step.name}: {line}"
        assert (line["status"], line["completed"]) == (200, True), where
        assert line["cache"] == step.outcome, where
        assert line["saved_tokens"] == answer.saved, where
        computed = line["prompt_tokens"] + line["completion_tokens"]
        if step.outcome in HITS:
            assert computed == 0 and line["servers"] == [], where
        elif answer.usage:
            assert computed + answer.saved == answer.tokens, where
        if case.surface in GENERATION and step.outcome in ("miss", "bypass"):
            # The prefill hop for a prompt the decode server lacks over the threshold of
            # (a tenant's first; tools make a short question long), never for a short one.
            # Responses API prompts are not tokenized for placement (backends/fleet/kv/tokens.py):
            # their estimated length decides, so each long one hops again.
            long = line["prompt_tokens"] >= PREFILL_THRESHOLD
            again = step is not steps[0] and case.surface != "responses"
            assert line["pd_hop"] is (long and not again), where
        finding = {"flag": "prompt:EMAIL_ADDRESS:flag", "redact": "prompt:CREDIT_CARD:redact"}
        if case.dlp in finding:
            assert finding[case.dlp] in (line.get("findings") or []), where
        for form in secret_forms(secret):
            assert form not in json.dumps(line)
    return lines


def check_ledger(
    who: Caller, steps: list[Step], answers: dict[str, Answer], lines: list[dict[str, Any]]
) -> None:
    (row,) = who.get("/v1/usage", tenant=who.tenant, group_by="tenant")["data"]
    outcomes = [s.outcome for s in steps]
    assert row["requests"] == len(steps), row
    assert row["exact_hits"] == outcomes.count("exact"), row
    # A partial answer is no hit in any count (the decision on partial answers).
    assert row["semantic_hits"] == outcomes.count("semantic"), row
    saved = sum(answers[s.name].saved for s in steps)
    assert row["tokens_saved"] == saved, row  # partial: its cached items' tokens are saved
    usd = sum(float(answers[s.name].headers.get("x-semcache-saved-usd", 0)) for s in steps)
    assert row["saved_usd"] == pytest.approx(usd, abs=1e-8 * len(steps)), row
    told = sum(
        line["prompt_tokens"] + line["completion_tokens"] + line["saved_tokens"] for line in lines
    )
    assert row["prompt_tokens"] + row["completion_tokens"] == told, row


def check_limits(who: Caller, count: int, lines: list[dict[str, Any]]) -> None:
    """The rate windows took one request per answer and the tokens the backends computed: a
    hit spends none (``hits_spend_tokens = false``), a partial one only what was computed."""
    computed = sum(line["prompt_tokens"] + line["completion_tokens"] for line in lines)
    probes = 0

    def settled() -> bool:
        nonlocal probes
        probe = httpx.get(
            f"{who.gateway.url}/v1/models", headers={"authorization": f"Bearer {who.token}"}
        )
        probes += 1
        requests = RATE_LIMITS["requests_per_minute"] - int(
            probe.headers["x-ratelimit-remaining-requests"]
        )
        assert requests == count + probes, dict(probe.headers)
        tokens = RATE_LIMITS["tokens_per_minute"] - int(
            probe.headers["x-ratelimit-remaining-tokens"]
        )
        return tokens - 1 == computed  # the probe's own estimate: one token

    wait_until(settled, timeout_s=5, interval_s=0.1)


def check_tenant_metric(who: Caller, count: int, page: str) -> None:
    counted = sum(
        sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == "semcache_tenant_requests_total"
        and sample.labels["tenant"] == who.tenant
        and sample.labels["model"] != "-"
    )
    assert counted == count


def check_cache_metrics(steps: list[Step], before: str, after: str) -> None:
    """The case's outcomes on the gateway's counters of requests (the exact tier's own
    counters count item lookups of pooling requests too, so they are not read here)."""

    def delta(name: str, **labels: str) -> float:
        return parse_metric(after, name, labels) - parse_metric(before, name, labels)

    outcomes = [s.outcome for s in steps]
    # A partial answer is no hit in any count (the decision on partial answers).
    assert delta("semcache_semantic_hits_total") == outcomes.count("semantic")
    for outcome in OUTCOMES:  # the request log's outcomes, counted alike
        counted = delta("semcache_request_cache_outcomes_total", outcome=outcome)
        assert counted == outcomes.count(outcome), outcome


def check_nothing_holds(matrix: Matrix, gateway: GatewayProcess, secret: str) -> None:
    """No file of either gateway's data dir (caches, semantic records, logs, ledger, keys)
    and no line either printed holds the redacted value."""
    forms = [f.encode() for f in secret_forms(secret)]
    for root in matrix.data_dirs:
        for path in root.rglob("*"):
            if path.is_file() and "models" not in path.relative_to(root).parts:
                data = path.read_bytes()
                assert not any(f in data for f in forms), path
    for served in (matrix.closed, matrix.open):
        output = served.output().encode()
        assert not any(f in output for f in forms)
