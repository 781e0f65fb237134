"""Verified vs static chat caching on a mixed workload, per source and overall.

    flock /tmp/semcache-heavy.lock .venv/bin/python bench/semantic_mixed.py \\
        [--limit 600] [--repeated 0] [--seeds 1] [--verifier]

One stream interleaves four labelled sources whose safe cosine thresholds differ (QQP's
test split, the paraphrase pairs, the seeded templated hard negatives, the classifier's
labelled sentences as classification prompts; ``semcache.tuning.mixed``), and the stream
evaluation (``semcache.tuning.stream_eval``, the code of ``semcache calibrate --stream``)
replays every policy on it with the real encoder (vectors cached under .data/embeddings).
Per max_error it prints the verified mode per source with Wilson bounds, the static
threshold tuned after the fact to hold max_error overall (and its per-source errors), the
best static threshold that holds max_error on every source, the verified/static hit ratio
and the ceiling.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

from backends.local.classifier import DEFAULT_EXAMPLES
from semcache.semantic.verified.decisions import VerifiedParams
from semcache.tuning.mixed import SENTENCES, SOURCES, source_pairs, stream_of_sources
from semcache.tuning.pairs import (
    EMBEDDING_CACHE_DIR,
    PARAPHRASE_PAIRS,
    QQP_PAIRS,
    load_pairs,
    split_pairs,
)
from semcache.tuning.stream_eval import compare_stream
from semcache.tuning.stream_report import format_comparison, format_sources
from server.encoders import load_encoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, default=600, help="questions per source")
    parser.add_argument("--repeated", type=int, default=0, help="requests per source (0: once)")
    parser.add_argument("--clusters", type=int, default=200, help="--repeated: per source")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1, help="streams, seeds from --seed")
    parser.add_argument("--verifier", action="store_true", help="also the pair verifier")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--sources",
        default=",".join(SOURCES),
        help=f"comma list of {', '.join(SOURCES)} and {SENTENCES} (the classifier's sentences "
        "as /v1/classify caches them)",
    )
    parser.add_argument(
        "--prior-neighbours",
        type=int,
        default=VerifiedParams(max_error=0.05).prior_neighbours,
        help="the verified prior's neighbourhood (0: the whole partition); default: the product's",
    )
    args = parser.parse_args()
    names = [name.strip() for name in args.sources.split(",") if name.strip()]
    started = time.time()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(
        f"commit {commit}; {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}; "
        f"prior_neighbours {args.prior_neighbours}"
    )
    files = {"paraphrase": PARAPHRASE_PAIRS, "classify": DEFAULT_EXAMPLES}
    qqp_test = split_pairs(load_pairs(QQP_PAIRS))["test"]  # the verifier never saw it
    for seed in range(args.seed, args.seed + args.seeds):
        pairs = {
            name: qqp_test
            if name == "qqp"
            else source_pairs(name, files, seed=seed, limit=args.limit)
            for name in names
        }
        stream = stream_of_sources(
            pairs, seed=seed, limit=args.limit, repeated=args.repeated, clusters=args.clusters
        )
        counts = {name: stream.source.count(name) for name in names}
        print(f"\n== seed {seed}: {len(stream.texts)} requests {counts} ==")
        rows = compare_stream(
            stream,
            VerifiedParams(max_error=0.05, prior_neighbours=args.prior_neighbours),
            encoder=load_encoder(threads=args.threads),
            seed=seed,
            use_verifier=args.verifier,
            cache_dir=EMBEDDING_CACHE_DIR,
        )
        print(format_comparison(rows))
        print(format_sources(rows))
        for row in rows:
            tuned = row.static_cosine
            if tuned is not None:
                broken = [n for n, o in tuned.by_source.items() if o.error_rate > row.max_error]
                print(
                    f"max_error {row.max_error:.2f}: the threshold tuned overall "
                    f"({tuned.policy.split()[-1]}) violates it on {broken or 'no source'}"
                )
    print(f"\n({time.time() - started:.0f} s; load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
