"""Micro-batching gain: semantic lookups one at a time vs concurrently, in texts/s.

    .venv/bin/python -m bench.semantic_batching [--entries 2000] [--rounds 3] [--threads N]

A lookup is the gateway's real path: ``SemanticCache.lookup`` of one text (the
micro-batching encoder, then a search of one flat partition holding ``--entries`` real QQP
questions). For 1, 8, 32 and 64 clients, the same lookups run one after another, then all
at once (the encoder batches the ones that queue while a batch runs). Prints both rates
side by side with the model calls the concurrent run needed; best of ``--rounds``. Then the
ceiling: the same texts through the model alone, one per call vs all in one call.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time

from semcache.semantic.cache import SemanticCache
from semcache.semantic.index import SemanticIndex
from semcache.semantic.partition_types import IndexSettings
from semcache.semantic_settings import SemanticRule
from semcache.tuning.pairs import QQP_PAIRS, load_pairs, unique_texts
from server.encoders import load_encoder

RULE = SemanticRule(enabled=True, threshold=0.9)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    encoder = load_encoder(threads=args.threads)
    texts = unique_texts(load_pairs(QQP_PAIRS))
    random.Random(1).shuffle(texts)
    cached, queries = texts[: args.entries], texts[args.entries : args.entries + 64]
    index = SemanticIndex(IndexSettings(dimensions=encoder.dimensions, background=False))
    cache = SemanticCache(encoder, index)
    key = cache.partition_key(scope="bench", model_revision="r", task="embeddings", template="t")
    vectors = encoder.encode_sync(cached)
    await cache.insert(key, cached, cached, 3600.0, rule=RULE, vectors=vectors)
    for _ in range(20):  # warm the model and the thread hand-off
        await cache.lookup(key, [queries[0]], RULE)
    print(
        f"encoder {encoder.version}; {args.entries} cached QQP questions (flat partition); "
        f"{os.cpu_count()} cores, load average {load_before:.1f} before"
    )
    print(f"{'clients':>7}  {'one at a time':>15}  {'concurrent':>12}  {'gain':>5}  model calls")
    for clients in (1, 8, 32, 64):
        batch = queries[:clients]
        alone: list[float] = []
        together: list[float] = []
        calls: list[int] = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for text in batch:
                await cache.lookup(key, [text], RULE)
            alone.append(clients / (time.perf_counter() - t0))
            before = encoder.stats.model_calls
            t0 = time.perf_counter()
            await asyncio.gather(*(cache.lookup(key, [text], RULE) for text in batch))
            together.append(clients / (time.perf_counter() - t0))
            calls.append(encoder.stats.model_calls - before)
        a, b = max(alone), max(together)
        print(
            f"{clients:>7}  {a:>9.0f} text/s  {b:>6.0f} text/s  {b / a:>4.1f}x  "
            f"{min(calls)}-{max(calls)} for {clients} lookups",
            flush=True,
        )
    print("the ceiling: the model alone (encode_sync), texts one per call vs one call for all")
    for clients in (8, 32, 64):
        batch = queries[:clients]
        single: list[float] = []
        joint: list[float] = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for text in batch:
                encoder.encode_sync([text])
            single.append(clients / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            encoder.encode_sync(batch)
            joint.append(clients / (time.perf_counter() - t0))
        a, b = max(single), max(joint)
        print(
            f"{clients:>7}  {a:>9.0f} text/s  {b:>6.0f} text/s  {b / a:>4.1f}x  (no gateway code)",
            flush=True,
        )
    print(f"(load average {os.getloadavg()[0]:.1f} after)")
    await cache.aclose()
    await encoder.aclose()


if __name__ == "__main__":
    asyncio.run(main())
