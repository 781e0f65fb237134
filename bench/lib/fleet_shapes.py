"""The fleet workload shapes of issue 48, seeded, for the real servers and the simulator alike.

A shape is a list of chat requests in arrival order (the caller draws Poisson arrival times
at a stated fraction of the fleet's saturation rate). Texts are words of a small English
vocabulary that SmolLM2's tokenizer (and the simulator) count as one token each, so sizes are
given in tokens, relative to one server's KV cache (``kv_tokens``):

- ``per-tenant``: today's trace (``kv_placement.py``): 4 tenants a server, a system prompt
  each (4-12 % of a server's KV), Zipf 1.1 popularity, 2 conversations a tenant of up to 4
  turns;
- ``shared-prefix``: a few tenants (2 a 3 servers), each one shared instruction block (6 %
  of a server's KV: identical first tokens for all its users), 6 users a server, each with a
  long document of their own (9 %), multi-turn: the reuse is in the per-user part
  (production-stack #59, llm-d's precise-prefix workload: per-user contexts behind shared
  instructions);
- ``hot-tenant``: Zipf 1.5 over 2 tenants a server (system prompt 10 %): the hottest takes
  about half the requests, more than one server's worth at the rates used (llm-d's
  high-sharing workload, Preble's hot prefixes);
- ``pressure``: a distinct system prompt per tenant (15 % of a server's KV each), together
  1.5x one server's KV a 3 servers (0.5x a server's per server), Zipf 1.0, one question each;
- ``long-history``: multi-turn chats whose history grows on the decode server (a 8 %
  context, then turns of a question and an answer), mixed 2:1 with fresh long RAG-like
  prompts (20 %), for prefill/decode;
- ``no-sharing``: a unique prompt per request (10 %).

Every request carries its tenant (own API token, own ``cache_salt``), its conversation and
its class (``turn``, ``fresh``, ``first``) for per-class figures.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

VOCABULARY = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education"
).split()
"""Words of one token each for SmolLM2's tokenizer (a leading space included)."""

SHAPES = ("per-tenant", "shared-prefix", "hot-tenant", "pressure", "long-history", "no-sharing")


@dataclass(frozen=True)
class ShapeRequest:
    tenant: str
    conversation: str
    messages: tuple[tuple[str, str], ...]
    """``(role, content)`` pairs."""
    max_tokens: int
    kind: str
    """``first`` (a conversation's first turn), ``turn`` (a later one), ``fresh`` (a prompt
    nobody sent before: long-history's RAG prompts, no-sharing)."""

    def chat(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]


@dataclass(frozen=True)
class Shape:
    name: str
    requests: list[ShapeRequest]
    rate_fraction: float
    """Arrivals as a fraction of the fleet's saturation rate."""
    params: Mapping[str, object]


def words(seed: str, n: int) -> str:
    """``n`` one-token words, the same for the same ``seed``."""
    rng = random.Random(seed)
    return " ".join(rng.choices(VOCABULARY, k=n))


class Conversations:
    """Multi-turn conversations that append to their history and end after ``turns``."""

    def __init__(self, rng: random.Random, turns: int, question: int, answer: int) -> None:
        self.rng = rng
        self.turns = turns
        self.question = question
        self.answer = answer
        self.histories: dict[str, list[tuple[str, str]]] = {}
        self.count = 0

    def next(self, tenant: str, conversation: str, opening: list[tuple[str, str]]) -> ShapeRequest:
        self.count += 1
        history = self.histories.get(conversation)
        kind = "turn"
        if history is None or (len(history) - len(opening)) >= 2 * self.turns:
            history, kind = list(opening), "first"
        question = words(f"q{self.count}", self.question)
        asked = [*history, ("user", question)]
        self.histories[conversation] = [*asked, ("assistant", words(f"a{self.count}", self.answer))]
        return ShapeRequest(tenant, conversation, tuple(asked), 8, kind)


def zipf_weights(n: int, s: float) -> list[float]:
    return [1 / (rank + 1) ** s for rank in range(n)]


def per_tenant(servers: int, kv: int, n: int, rng: random.Random) -> Shape:
    tenants = 4 * servers
    prompts = [words(f"sys{t}", rng.randint(kv // 25, kv // 8)) for t in range(tenants)]
    weights = zipf_weights(tenants, 1.1)
    talk = Conversations(rng, turns=4, question=12, answer=8)
    out = []
    for _ in range(n):
        t = rng.choices(range(tenants), weights)[0]
        c = f"t{t}-c{rng.randrange(2)}"
        out.append(talk.next(f"t{t}", c, [("system", prompts[t])]))
    params = {"tenants": tenants, "system tokens": f"{kv // 25}-{kv // 8}", "zipf": 1.1}
    return Shape("per-tenant", out, 0.7, {**params, "conversations/tenant": 2, "turns": 4})


def shared_prefix(servers: int, kv: int, n: int, rng: random.Random) -> Shape:
    tenants = max(2, round(2 * servers / 3))
    users = 6 * servers // tenants
    shared = {t: words(f"inst{t}", kv * 6 // 100) for t in range(tenants)}
    talk = Conversations(rng, turns=6, question=15, answer=10)
    out = []
    for _ in range(n):
        t = rng.randrange(tenants)
        u = rng.randrange(users)
        doc = words(f"doc{t}-{u}", kv * 9 // 100)
        opening = [("system", shared[t]), ("user", f"My document: {doc}"), ("assistant", "ok")]
        out.append(talk.next(f"t{t}", f"t{t}-u{u}", opening))
    params = {
        "tenants": tenants,
        "users/tenant": users,
        "shared tokens": kv * 6 // 100,
        "document tokens": kv * 9 // 100,
        "turns": 6,
    }
    return Shape("shared-prefix", out, 0.8, params)


def hot_tenant(servers: int, kv: int, n: int, rng: random.Random) -> Shape:
    tenants = 2 * servers
    prompts = [words(f"hot{t}", kv // 10) for t in range(tenants)]
    weights = zipf_weights(tenants, 1.5)
    talk = Conversations(rng, turns=2, question=20, answer=10)
    out = []
    for _ in range(n):
        t = rng.choices(range(tenants), weights)[0]
        c = f"t{t}-c{rng.randrange(4 * servers)}"
        out.append(talk.next(f"t{t}", c, [("system", prompts[t])]))
    share = weights[0] / sum(weights)
    params = {"tenants": tenants, "zipf": 1.5, "hottest share": round(share, 2)}
    return Shape("hot-tenant", out, 0.8, {**params, "system tokens": kv // 10, "turns": 2})


def pressure(servers: int, kv: int, n: int, rng: random.Random) -> Shape:
    prefix = kv * 15 // 100
    tenants = max(10, round(10 * servers / 3))
    prompts = [words(f"pr{t}", prefix) for t in range(tenants)]
    weights = zipf_weights(tenants, 1.0)
    out = []
    for i in range(n):
        t = rng.choices(range(tenants), weights)[0]
        asked = (("system", prompts[t]), ("user", words(f"pq{i}", 20)))
        out.append(ShapeRequest(f"t{t}", f"r{i}", asked, 8, "turn"))
    params = {
        "tenants": tenants,
        "system tokens": prefix,
        "distinct / one server's KV": round(tenants * prefix / kv, 2),
        "zipf": 1.0,
    }
    return Shape("pressure", out, 0.9, params)


def long_history(servers: int, kv: int, n: int, rng: random.Random) -> Shape:
    sessions = 4 * servers
    talk = Conversations(rng, turns=10, question=40, answer=30)
    out = []
    for i in range(n):
        if rng.random() < 1 / 3:
            asked = (("user", words(f"rag{i}", kv // 5) + " Summarise."),)
            out.append(ShapeRequest(f"s{i % sessions}", f"rag{i}", asked, 24, "fresh"))
            continue
        s = rng.randrange(sessions)
        opening = [("system", words(f"ctx{s}", kv * 8 // 100))]
        request = talk.next(f"s{s}", f"s{s}", opening)
        out.append(ShapeRequest(request.tenant, request.conversation, request.messages, 24, "turn"))
    params = {
        "sessions": sessions,
        "context tokens": kv * 8 // 100,
        "turn tokens": 70,
        "RAG tokens": kv // 5,
        "RAG share": "1/3",
        "turns": 10,
    }
    return Shape("long-history", out, 0.7, params)


def no_sharing(servers: int, kv: int, n: int, rng: random.Random) -> Shape:
    out = [
        ShapeRequest(
            f"t{i % (4 * servers)}", f"u{i}", (("user", words(f"uniq{i}", kv // 10)),), 8, "fresh"
        )
        for i in range(n)
    ]
    return Shape("no-sharing", out, 0.7, {"prompt tokens": kv // 10})


BUILDERS: dict[str, Callable[[int, int, int, random.Random], Shape]] = {
    "per-tenant": per_tenant,
    "shared-prefix": shared_prefix,
    "hot-tenant": hot_tenant,
    "pressure": pressure,
    "long-history": long_history,
    "no-sharing": no_sharing,
}


def build(name: str, servers: int, kv_tokens: int, requests: int, seed: int) -> Shape:
    """The shape ``name`` for a fleet of ``servers`` with ``kv_tokens`` of KV each."""
    return BUILDERS[name](servers, kv_tokens, requests, random.Random(f"{name}:{seed}"))


def arrivals(count: int, rate_per_s: float, seed: int) -> list[float]:
    """Poisson arrival times (seconds from the start)."""
    rng = random.Random(f"arrivals:{seed}")
    at, out = 0.0, []
    for _ in range(count):
        at += rng.expovariate(rate_per_s)
        out.append(at)
    return out
