"""Request streams for the stream evaluation, built from labelled pairs.

Labelled duplicate pairs become duplicate clusters (connected components of the pairs
labelled 1; a question in no such pair is a cluster of its own); a cached answer is right
for a request when both questions are in one cluster.

``build_stream`` replays each question once, in a seeded random order.
``build_repeated_stream`` makes the workload vCache targets instead: questions asked again
and again. Requests draw a cluster by a Zipf-like popularity, one of its questions, and a
surface variant of it (case, final question mark, a short lead-in or thanks: users wording
the same question a little differently); a text already asked is the exact cache's job and
is left out of the stream.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import msgspec

from semcache.tuning.pairs import Pair


class Stream(msgspec.Struct, kw_only=True):
    texts: list[str]
    cluster: list[int]
    """Cluster id of each text (same id: the same question)."""
    source: list[str] = []
    """A mixed stream's source of each text (``build_mixed_stream``); empty for one source."""


def _shuffled_components(
    pairs: Sequence[Pair], rng: random.Random
) -> tuple[dict[str, str], dict[str, list[str]], list[str]]:
    """The duplicate clusters (text → root), the texts of each component of the pairs (any
    label) by root, and those roots in a seeded order."""
    everything = _components(pairs, lambda p: True)
    duplicates = _components(pairs, lambda p: p.label == 1)
    groups: dict[str, list[str]] = {}
    for text, root in everything.items():
        groups.setdefault(root, []).append(text)
    roots = sorted(groups)
    rng.shuffle(roots)
    return duplicates, groups, roots


def build_stream(pairs: Sequence[Pair], *, limit: int | None, seed: int) -> Stream:
    """The questions of the pairs in a seeded random order, with their clusters.

    With ``limit``, whole components of the pairs (any label) are drawn until ``limit``
    questions are reached, so duplicates and hard negatives stay together.
    """
    rng = random.Random(seed)
    duplicates, groups, roots = _shuffled_components(pairs, rng)
    texts: list[str] = []
    for root in roots:
        if limit is not None and len(texts) >= limit:
            break
        texts.extend(sorted(groups[root]))
    rng.shuffle(texts)
    ids: dict[str, int] = {}
    cluster = [ids.setdefault(duplicates.get(t, t), len(ids)) for t in texts]
    return Stream(texts=texts, cluster=cluster)


_CASES: tuple[Callable[[str], str], ...] = (lambda t: t, str.lower)
_ENDINGS: tuple[Callable[[str], str], ...] = (lambda t: t, lambda t: t.rstrip().rstrip("?"))
_WRAPS: tuple[Callable[[str], str], ...] = (
    lambda t: t,
    lambda t: f"Question: {t}",
    lambda t: f"{t} Thanks!",
    lambda t: f"Can you tell me: {t}",
)


def variant(text: str, rng: random.Random) -> str:
    """One seeded surface variant of a question (16 in all)."""
    case, ending, wrap = rng.choice(_CASES), rng.choice(_ENDINGS), rng.choice(_WRAPS)
    return wrap(ending(case(text.strip())))


class RepeatedStream(msgspec.Struct, kw_only=True):
    stream: Stream
    drawn: int
    """Requests drawn; those whose text was asked before (exact hits) are not in ``stream``."""
    clusters: int
    """Clusters the requests were drawn from."""


def build_repeated_stream(
    pairs: Sequence[Pair], *, requests: int, clusters: int, seed: int, zipf_s: float = 1.0
) -> RepeatedStream:
    """``requests`` draws from ``clusters`` duplicate clusters with popularity ``1 / rank **
    zipf_s`` (ranks in a seeded order), each a surface variant of one of the cluster's
    questions; exact repeats are dropped (see module docstring).

    Clusters are taken whole components of the pairs (any label) at a time, so hard
    negatives of a popular question are asked too.
    """
    rng = random.Random(seed)
    duplicates, groups, roots = _shuffled_components(pairs, rng)
    members: dict[str, list[str]] = {}
    for root in roots:
        if len(members) >= clusters:
            break
        for text in sorted(groups[root]):
            members.setdefault(duplicates.get(text, text), []).append(text)
    chosen = list(members)
    rng.shuffle(chosen)
    weights = [1.0 / (rank + 1) ** zipf_s for rank in range(len(chosen))]
    ids = {root: i for i, root in enumerate(chosen)}
    texts: list[str] = []
    cluster: list[int] = []
    seen: set[str] = set()
    for root in rng.choices(chosen, weights=weights, k=requests):
        text = variant(rng.choice(members[root]), rng)
        if text in seen:
            continue
        seen.add(text)
        texts.append(text)
        cluster.append(ids[root])
    return RepeatedStream(
        stream=Stream(texts=texts, cluster=cluster), drawn=requests, clusters=len(chosen)
    )


def build_mixed_stream(streams: dict[str, Stream], *, seed: int) -> Stream:
    """The streams of several labelled sources interleaved in one, in a seeded order that
    keeps each source's own order; clusters never span sources (an answer of one workload
    is wrong for another), and each text keeps its source's name."""
    rng = random.Random(seed)
    names = sorted(streams)
    order = [name for name in names for _ in streams[name].texts]
    rng.shuffle(order)
    offset: dict[str, int] = {}
    base = 0
    for name in names:
        offset[name] = base
        base += max(streams[name].cluster, default=-1) + 1
    position = dict.fromkeys(names, 0)
    texts: list[str] = []
    cluster: list[int] = []
    seen: set[str] = set()
    source: list[str] = []
    for name in order:
        k = position[name]
        position[name] = k + 1
        text = streams[name].texts[k]
        if text in seen:  # the same text in two sources: the exact cache's, left out
            continue
        seen.add(text)
        texts.append(text)
        cluster.append(offset[name] + streams[name].cluster[k])
        source.append(name)
    return Stream(texts=texts, cluster=cluster, source=source)


def source_stream(stream: Stream, name: str) -> Stream:
    """The requests of one source of a mixed stream, in order."""
    keep = [i for i, s in enumerate(stream.source) if s == name]
    return Stream(
        texts=[stream.texts[i] for i in keep],
        cluster=[stream.cluster[i] for i in keep],
        source=[name] * len(keep),
    )


def _components(pairs: Sequence[Pair], keep: Callable[[Pair], bool]) -> dict[str, str]:
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for pair in pairs:
        a, b = find(pair.text_a), find(pair.text_b)
        if keep(pair) and a != b:
            low, high = sorted((a, b))
            parent[high] = low
    return {text: find(text) for text in list(parent)}
