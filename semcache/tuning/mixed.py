"""A mixed workload for the stream evaluation: several labelled sources in one stream.

One gateway's traffic mixes workloads whose safe cosine thresholds differ: questions that
mean the same in other words (QQP, the paraphrase pairs), templated prompts whose near
duplicates differ in an entity, a number, a unit or a negation (``templates``), and
classification prompts, right to share exactly when their labels agree (the embedded
classifier's labelled sentences). ``mixed_stream`` builds each source's stream as
``stream_build`` does and interleaves them with a seed (``build_mixed_stream``); the
evaluation (``stream_eval.compare``) then counts every policy per source and overall.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from pathlib import Path

import msgspec

from semcache.tuning.pairs import Pair, load_pairs
from semcache.tuning.stream_build import (
    Stream,
    build_mixed_stream,
    build_repeated_stream,
    build_stream,
)
from semcache.tuning.templates import generate_template_pairs

SOURCES = ("qqp", "paraphrase", "templates", "classify")
"""``templates`` is generated (seeded); the others read a file named by the caller."""
SENTENCES = "sentences"
"""Not in the mix: the ``classify`` file's sentences as they are, the items of the
classification route's cache (``/v1/classify``), not wrapped in a chat prompt."""

CLASSIFY_PROMPT = "Classify the sentiment of this review as POSITIVE or NEGATIVE: {text}"


class _LabelledText(msgspec.Struct):
    text: str
    label: str


def classification_pairs(
    path: Path, *, limit: int | None = None, seed: int = 0, prompt: str = CLASSIFY_PROMPT
) -> list[Pair]:
    """The classifier's labelled sentences as classification prompts: two prompts are a
    label-1 pair when their labels agree (the answer, a label, is right for both).

    Prompts of one label are all one cluster, so ``limit`` samples sentences (seeded)
    instead of drawing whole clusters."""
    decoder = msgspec.json.Decoder(_LabelledText)
    rows = [decoder.decode(line) for line in path.read_bytes().splitlines() if line.strip()]
    if limit is not None and limit < len(rows):
        rows = random.Random(seed).sample(rows, limit)
    by_label: dict[str, list[str]] = {}
    for row in rows:
        by_label.setdefault(row.label, []).append(prompt.format(text=row.text))
    pairs = [Pair(a, b, 1) for texts in by_label.values() for a, b in itertools.pairwise(texts)]
    firsts = [texts[0] for _, texts in sorted(by_label.items())]
    pairs.extend(Pair(a, b, 0) for a, b in itertools.pairwise(firsts))
    return pairs


def source_pairs(
    name: str, files: dict[str, Path], *, seed: int, limit: int | None = None
) -> list[Pair]:
    """The labelled pairs of one source (``files``: the file of each file-backed source)."""
    if name == "templates":
        return generate_template_pairs(seed=seed).pairs
    if name == SENTENCES:
        if "classify" not in files:
            raise ValueError("no file for source 'sentences' (it reads the classify file)")
        return classification_pairs(files["classify"], limit=limit, seed=seed, prompt="{text}")
    if name not in SOURCES:
        raise ValueError(f"unknown source {name!r} (known: {', '.join(SOURCES)})")
    if name not in files:
        raise ValueError(f"no file for source {name!r}")
    if name == "classify":
        return classification_pairs(files[name], limit=limit, seed=seed)
    return load_pairs(files[name])


def mixed_stream(
    names: Sequence[str],
    files: dict[str, Path],
    *,
    seed: int,
    limit: int | None = None,
    repeated: int = 0,
    clusters: int = 500,
) -> Stream:
    """Each source's stream (``limit`` questions at most, or ``repeated`` requests over
    ``clusters`` clusters, per source) interleaved with ``seed``."""
    pairs = {name: source_pairs(name, files, seed=seed, limit=limit) for name in names}
    return stream_of_sources(pairs, seed=seed, limit=limit, repeated=repeated, clusters=clusters)


def stream_of_sources(
    pairs: dict[str, list[Pair]],
    *,
    seed: int,
    limit: int | None = None,
    repeated: int = 0,
    clusters: int = 500,
) -> Stream:
    """``mixed_stream`` on pairs already loaded, by source name."""
    streams = {
        name: (
            build_repeated_stream(part, requests=repeated, clusters=clusters, seed=seed).stream
            if repeated
            else build_stream(part, limit=limit, seed=seed)
        )
        for name, part in pairs.items()
    }
    return build_mixed_stream(streams, seed=seed)
