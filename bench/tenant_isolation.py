"""What keeping tenants apart costs in hit rate: the mixed workload shared vs scoped per tenant.

    flock /tmp/semcache-heavy.lock .venv/bin/python bench/tenant_isolation.py \\
        [--requests 1500] [--clusters 200] [--tenants 1,4,16,64] [--seeds 3]

The sources of the semantic mixed workload (QQP's test split, the paraphrase pairs, the
templated hard negatives, the classifier's prompts and its sentences; ``semcache.tuning.mixed``)
give each source's texts and duplicate clusters. Requests are drawn per source: a cluster by
popularity (``1 / rank``, Zipf s = 1), one of its texts, as written or as one of 16 surface
variants (``variant``), so a stream holds exact repeats, near-identical texts and
paraphrases; each request's tenant is drawn by the same law over ``--tenants`` tenants (a
few large ones, a long tail), independently of what it asks (every tenant wants the popular
texts: the case where sharing helps most). Every request is replayed, with the real MiniLM
vectors, against the product's rule: an exact repeat in the partition is a hit, else the
nearest entry at cosine ``--threshold`` or more (the embeddings route's 0.99 and the
classification route's 0.9 by default), else a miss that is stored. ``shared`` is one
partition for all tenants (a ``shared = true`` rule); ``scoped`` one per tenant (the shipped
policy). A semantic hit on another cluster is counted wrong, to show the threshold's price
beside isolation's.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import time
from collections.abc import Sequence

import numpy as np

from backends.local.classifier import DEFAULT_EXAMPLES
from semcache.tuning.mixed import SENTENCES, SOURCES, source_pairs
from semcache.tuning.pairs import (
    EMBEDDING_CACHE_DIR,
    PARAPHRASE_PAIRS,
    QQP_PAIRS,
    embed_texts,
    load_pairs,
    split_pairs,
)
from semcache.tuning.stream_build import Stream, build_stream, variant
from server.encoders import load_encoder


class Request:
    __slots__ = ("cluster", "tenant", "text")

    def __init__(self, text: str, cluster: int, tenant: int) -> None:
        self.text, self.cluster, self.tenant = text, cluster, tenant


def zipf(n: int) -> list[float]:
    return [1.0 / (rank + 1) for rank in range(n)]


def draw(
    streams: dict[str, Stream], *, requests: int, clusters: int, tenants: int, seed: int
) -> list[Request]:
    """``requests`` per source over its ``clusters`` most popular clusters, interleaved."""
    rng = random.Random(seed)
    out: list[Request] = []
    offset = 0
    for stream in streams.values():
        members: dict[int, list[str]] = {}
        for text, cluster in zip(stream.texts, stream.cluster, strict=True):
            if cluster in members or len(members) < clusters:
                members.setdefault(cluster, []).append(text)
        chosen = list(members)
        rng.shuffle(chosen)
        for cluster in rng.choices(chosen, weights=zipf(len(chosen)), k=requests):
            text = rng.choice(members[cluster])
            if rng.random() < 0.5:
                text = variant(text, rng)
            tenant = rng.choices(range(tenants), weights=zipf(tenants))[0]
            out.append(Request(text, offset + cluster, tenant))
        offset += max(stream.cluster) + 1
    rng.shuffle(out)
    return out


def replay(
    stream: Sequence[Request], vectors: dict[str, np.ndarray], threshold: float, *, scoped: bool
) -> tuple[int, int, int]:
    """(exact hits, semantic hits, wrong semantic hits) of the stream under the rule."""
    seen: dict[int, set[str]] = {}
    entries: dict[int, list[np.ndarray]] = {}
    clusters: dict[int, list[int]] = {}
    exact = semantic = wrong = 0
    for req in stream:
        part = req.tenant if scoped else 0
        if req.text in seen.setdefault(part, set()):
            exact += 1
            continue
        vec = vectors[req.text]
        rows = entries.setdefault(part, [])
        if rows:
            sims = np.stack(rows) @ vec
            best = int(np.argmax(sims))
            if sims[best] >= threshold:
                semantic += 1
                wrong += clusters[part][best] != req.cluster
                continue
        seen[part].add(req.text)
        rows.append(vec)
        clusters.setdefault(part, []).append(req.cluster)
    return exact, semantic, wrong


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1500, help="requests per source")
    parser.add_argument("--clusters", type=int, default=200, help="clusters per source")
    parser.add_argument("--tenants", default="1,4,16,64")
    parser.add_argument("--thresholds", default="0.99,0.9")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    started = time.time()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(f"commit {commit}; {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}")
    files = {"paraphrase": PARAPHRASE_PAIRS, "classify": DEFAULT_EXAMPLES}
    qqp_test = split_pairs(load_pairs(QQP_PAIRS))["test"]
    names = [*SOURCES, SENTENCES]
    encoder = load_encoder()
    thresholds = [float(t) for t in args.thresholds.split(",")]
    counts = [int(t) for t in args.tenants.split(",")]
    print(
        f"{args.requests} requests per source over its {args.clusters} most popular clusters, "
        f"sources {', '.join(names)}; tenants Zipf s=1"
    )
    header = "seed  threshold  tenants  shared hits (exact+sem, wrong)  scoped hits  scoped/shared"
    print(header)
    ratios: dict[tuple[float, int], list[float]] = {}
    for seed in range(args.seed, args.seed + args.seeds):
        streams = {
            name: build_stream(
                qqp_test if name == "qqp" else source_pairs(name, files, seed=seed),
                limit=None,
                seed=seed,
            )
            for name in names
        }
        draws = {
            n: draw(streams, requests=args.requests, clusters=args.clusters, tenants=n, seed=seed)
            for n in counts
        }
        texts = sorted({r.text for stream in draws.values() for r in stream})
        embedded = embed_texts(encoder, texts, cache_dir=EMBEDDING_CACHE_DIR, show_progress=False)
        vectors = dict(zip(texts, embedded.of(texts), strict=True))
        for threshold in thresholds:
            for n in counts:
                stream = draws[n]
                shared = replay(stream, vectors, threshold, scoped=False)
                scoped = replay(stream, vectors, threshold, scoped=True)
                share_rate = (shared[0] + shared[1]) / len(stream)
                scope_rate = (scoped[0] + scoped[1]) / len(stream)
                ratio = scope_rate / share_rate if share_rate else 1.0
                ratios.setdefault((threshold, n), []).append(ratio)
                print(
                    f"{seed:>4}  {threshold:>9.2f}  {n:>7}  "
                    f"{share_rate:>6.3f} ({shared[0]}+{shared[1]}, {shared[2]:>3})"
                    f"{'':>11}{scope_rate:>6.3f} ({scoped[0]}+{scoped[1]}, {scoped[2]:>3})"
                    f"  {ratio:>6.3f}"
                )
    print("\nscoped / shared hit rate, over the seeds (min to max):")
    for (threshold, n), values in sorted(ratios.items()):
        spread = f"{min(values):.3f} to {max(values):.3f}"
        print(f"  threshold {threshold:.2f}, {n:>3} tenants: {spread}")
    print(f"\n({time.time() - started:.0f} s; load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
