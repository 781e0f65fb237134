"""Semantic lookup latency (encode + search) at 10k / 100k / 1M entries, flat vs HNSW.

    .venv/bin/python -m bench.semantic_lookup [--sizes 10000,100000,1000000] [--queries 300]
                                              [--ef-search 32,64,128,256]

Entries are QQP questions embedded by the cache encoder (about 73k distinct texts, cached
under .data/embeddings). Past that count, entries are the real vectors again with Gaussian
noise added (cosine about 0.94 to their source) and re-normalised: a 1M-entry partition of
tight near-duplicate clusters, harder for an ANN index than 1M distinct questions. Queries
are real QQP questions that are not in the index, each encoded alone (a lookup's real
path: the micro-batching encoder, then a search of one partition). Claims (issue 4): p50
<= 10 ms at 1M entries including encode; HNSW recall@1 against exact search >= 0.99.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import time
from pathlib import Path

import msgspec
import numpy as np
from tqdm import tqdm

from bench.lib.support import pct_ms
from semcache.semantic.encoder import Encoder
from semcache.semantic.partition import PartitionIndex
from semcache.semantic.partition_types import IndexSettings, Limits
from semcache.semantic.records import PartitionKey
from semcache.semantic.snapshot import read_partition, write_partition
from semcache.semantic.vector_index import configure_faiss_threads
from semcache.tuning.pairs import (
    QQP_PAIRS,
    embed_texts,
    load_pairs,
    split_pairs,
    unique_texts,
)
from server.encoders import load_encoder

KEY = PartitionKey(scope="bench", model_revision="r", task="embeddings", template="t")
NOISE_NORM = 0.35
CHUNK = 20_000


def corpus(base: np.ndarray, size: int, synthetic: str = "noise", seed: int = 0) -> np.ndarray:
    """``size`` unit vectors: the real ones first, then synthetic ones made from them.

    ``noise``: noisy copies of the real vectors (tight clusters of near-duplicates, the hard
    case for an ANN index). ``mix``: the normalised sum of two random real vectors (spread
    like new questions, no clusters).
    """
    if size <= len(base):
        return base[:size]
    rng = np.random.default_rng(seed)
    out = np.empty((size, base.shape[1]), dtype=np.float32)
    out[: len(base)] = base
    for start in range(len(base), size, CHUNK):
        end = min(start + CHUNK, size)
        if synthetic == "mix":
            pick = rng.integers(0, len(base), size=(end - start, 2))
            mixed = base[pick[:, 0]] + base[pick[:, 1]]
        else:
            source = base[np.arange(start, end) % len(base)]
            noise = rng.standard_normal(source.shape).astype(np.float32)
            noise *= NOISE_NORM / np.linalg.norm(noise, axis=1, keepdims=True)
            mixed = source + noise
        out[start:end] = mixed / np.linalg.norm(mixed, axis=1, keepdims=True)
    return out


def build(
    vectors: np.ndarray,
    texts: list[str],
    ann: bool,
    settings: IndexSettings,
    cache_dir: Path | None = None,
) -> tuple[PartitionIndex, float]:
    """The partition of ``vectors``; an HNSW one is read from ``cache_dir`` when built before
    (its snapshot), so that a rerun measures without the minutes of building."""
    size = len(vectors)
    limits = Limits(ann_after=0 if ann else size + 1, max_entries=size)
    if ann and cache_dir is not None and (cache_dir / "index.faiss").is_file():
        started = time.perf_counter()
        part = read_partition(cache_dir, settings, limits, now=time.time())
        print(f"{'':>9}  (HNSW read from {cache_dir} in {time.perf_counter() - started:.1f} s)")
        return part, float("nan")
    part = PartitionIndex(KEY, settings, limits)
    expires = [time.time() + 86_400.0] * CHUNK
    started = time.perf_counter()
    label = "HNSW" if ann else "flat"
    with tqdm(total=size, desc=f"build {label} {size:,}", unit="vec", leave=False) as bar:
        for start in range(0, size, CHUNK):
            end = min(start + CHUNK, size)
            part.add(
                [texts[i % len(texts)] for i in range(start, end)],
                vectors[start:end],
                [f"r{i}" for i in range(start, end)],
                expires[: end - start],
            )
            bar.update(end - start)
    elapsed = time.perf_counter() - started
    if ann and cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        write_partition(part, cache_dir)
    return part, elapsed


async def measure(
    encoder: Encoder,
    queries: list[str],
    flat: PartitionIndex,
    hnsw: PartitionIndex,
    ef_values: list[int],
) -> list[str]:
    encode_s: list[float] = []
    flat_s: list[float] = []
    hnsw_s: dict[int, list[float]] = {ef: [] for ef in ef_values}
    agree: dict[int, int] = dict.fromkeys(ef_values, 0)
    for text in queries:
        t0 = time.perf_counter()
        vector = await encoder.encode([text])
        t1 = time.perf_counter()
        exact = flat.search(vector, 1)[0][0].entry.id
        t2 = time.perf_counter()
        encode_s.append(t1 - t0)
        flat_s.append(t2 - t1)
        for ef in ef_values:
            t3 = time.perf_counter()
            found = hnsw.search(vector, 1, ef_search=ef)[0][0].entry.id
            hnsw_s[ef].append(time.perf_counter() - t3)
            agree[ef] += found == exact
    size = len(flat)
    total_flat = [e + s for e, s in zip(encode_s, flat_s, strict=True)]
    lines = [
        f"{size:>9,}  {'flat':<10}{pct_ms(flat_s, 50):>9.2f}{pct_ms(flat_s, 99):>9.2f}"
        f"{pct_ms(total_flat, 50):>10.2f}{pct_ms(total_flat, 99):>10.2f}{'1.000':>10}"
    ]
    auto = hnsw.ef_search()
    for ef in ef_values:
        total = [e + s for e, s in zip(encode_s, hnsw_s[ef], strict=True)]
        recall = agree[ef] / len(queries)
        name = f"hnsw ef={ef}" + ("*" if ef == auto else "")
        lines.append(
            f"{size:>9,}  {name:<10}{pct_ms(hnsw_s[ef], 50):>9.2f}"
            f"{pct_ms(hnsw_s[ef], 99):>9.2f}{pct_ms(total, 50):>10.2f}{pct_ms(total, 99):>10.2f}"
            f"{recall:>10.3f}"
        )
    lines.append(
        f"{'':>9}  encode alone: p50 {pct_ms(encode_s, 50):.2f} ms, "
        f"p99 {pct_ms(encode_s, 99):.2f} ms"
        f"; * = the efSearch the index picks at this size ({auto})"
    )
    return lines


async def batching_gain(encoder: Encoder, texts: list[str], rounds: int = 3) -> list[str]:
    """Per-text encode time: requests one after another vs the same requests concurrently.

    Concurrent requests queue while a batch runs and go into the next one (the encoder's
    micro-batching); a request alone is encoded at once.
    """
    lines: list[str] = []
    for clients in (8, 32, 64):
        batch = texts[:clients]
        alone: list[float] = []
        together: list[float] = []
        calls: list[int] = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for text in batch:
                await encoder.encode([text])
            alone.append((time.perf_counter() - t0) / clients)
            before = encoder.stats.model_calls
            t0 = time.perf_counter()
            await asyncio.gather(*(encoder.encode([text]) for text in batch))
            together.append((time.perf_counter() - t0) / clients)
            calls.append(encoder.stats.model_calls - before)
        a, b = min(alone) * 1000, min(together) * 1000
        lines.append(
            f"{clients:>3} requests of 1 text: one at a time {a:6.2f} ms/text, concurrent "
            f"{b:6.2f} ms/text ({max(calls)} model calls) -> {a / b:4.1f}x"
        )
    return lines


async def runtime_comparison(
    torch_encoder: Encoder, onnx_encoder: Encoder, texts: list[str]
) -> list[str]:
    """One short text at a time through each runtime, interleaved, and how far they differ."""
    timings: dict[str, list[float]] = {"torch": [], "onnx": []}
    for enc in (torch_encoder, onnx_encoder):
        for text in texts[:20]:  # warm up
            await enc.encode([text])
    for text in texts:
        for name, enc in (("torch", torch_encoder), ("onnx", onnx_encoder)):
            t0 = time.perf_counter()
            await enc.encode([text])
            timings[name].append(time.perf_counter() - t0)
    diff = float(np.abs(torch_encoder.encode_sync(texts) - onnx_encoder.encode_sync(texts)).max())
    torch_p50, onnx_p50 = pct_ms(timings["torch"], 50), pct_ms(timings["onnx"], 50)
    return [
        f"torch: p50 {torch_p50:.2f} ms, p99 {pct_ms(timings['torch'], 99):.2f} ms",
        f"onnx:  p50 {onnx_p50:.2f} ms, p99 {pct_ms(timings['onnx'], 99):.2f} ms"
        f"  -> {torch_p50 / onnx_p50:.2f}x; max |onnx - torch| per component {diff:.1e}",
    ]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--ef-search", default="32,64,128,256")
    parser.add_argument("--skip-batching", action="store_true")
    parser.add_argument(
        "--corpus",
        choices=["all", "test", "val"],
        default="all",
        help="QQP texts to index: all (~73k, encoded once) or one split's texts (~15k, "
        "already encoded by bench.semantic_quality); past its size, noisy copies",
    )
    parser.add_argument("--threads", type=int, default=None, help="encoder threads")
    parser.add_argument(
        "--runtime",
        choices=["auto", "onnx", "torch"],
        default="auto",
        help="the encoder's forward pass for the lookup table (auto: ONNX on a CPU)",
    )
    parser.add_argument(
        "--skip-runtimes", action="store_true", help="skip the torch vs ONNX encode comparison"
    )
    parser.add_argument("--hnsw-m", type=int, default=None, help="HNSW M (default: shipped)")
    parser.add_argument(
        "--synthetic",
        choices=["noise", "mix"],
        default="noise",
        help="entries past the real texts: noisy copies (clusters) or mixtures of two texts",
    )
    parser.add_argument(
        "--index-cache",
        type=Path,
        default=Path(".data/bench/hnsw"),
        help="keep built HNSW partitions here and reuse them ('' to always build)",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    ef_values = [int(s) for s in args.ef_search.split(",")]

    encoder = load_encoder(threads=args.threads, runtime=args.runtime)
    pairs = load_pairs(QQP_PAIRS)
    texts = unique_texts(pairs if args.corpus == "all" else split_pairs(pairs)[args.corpus])
    embedded = embed_texts(encoder, texts)
    order = list(range(len(texts)))
    random.Random(0).shuffle(order)
    query_rows, index_rows = order[: args.queries], order[args.queries :]
    queries = [texts[i] for i in query_rows]
    base = embedded.vectors[index_rows]
    base_texts = [texts[i] for i in index_rows]
    print(
        f"encoder {encoder.version} ({encoder.runtime}); {len(base):,} real QQP vectors "
        f"({args.corpus}); {len(queries)} held-out "
        f"query texts encoded one at a time; {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    if max(sizes) > len(base):
        print(
            f"sizes above {len(base):,}: real vectors plus noisy copies (noise norm {NOISE_NORM},"
            " cosine ~0.94 to the source), since encoding 1M texts on 2 cores takes hours"
        )
    settings = IndexSettings(dimensions=encoder.dimensions, background=False, use_gpu=False)
    if args.hnsw_m is not None:
        settings = msgspec.structs.replace(settings, hnsw_m=args.hnsw_m)
    for _ in range(20):  # warm the model and the thread hand-off
        await encoder.encode([queries[0]])
    if not args.skip_runtimes:
        other = load_encoder(
            threads=args.threads, runtime="torch" if encoder.runtime == "onnx" else "onnx"
        )
        pair = (other, encoder) if encoder.runtime == "onnx" else (encoder, other)
        print(f"encode one short text, torch vs ONNX Runtime, interleaved ({len(queries)} texts):")
        for line in await runtime_comparison(*pair, queries):
            print("  " + line, flush=True)
        await other.aclose()
    if not args.skip_batching:
        print("micro-batching (best of 3 rounds):")
        for line in await batching_gain(encoder, queries):
            print("  " + line, flush=True)
    print(
        f"{'entries':>9}  {'index':<10}{'search':>9}{'p99':>9}{'+encode':>10}{'p99':>10}"
        f"{'recall@1':>10}   (ms)"
    )
    for size in sizes:
        vectors = corpus(base, size, args.synthetic)
        configure_faiss_threads(os.cpu_count() or 1)  # build with every core
        flat, flat_build = build(vectors, base_texts, False, settings)
        cache_dir = None
        if str(args.index_cache):
            name = (
                f"{args.corpus}-{args.synthetic}-{size}-{args.queries}"
                f"-M{settings.hnsw_m}-efc{settings.hnsw_ef_construction}"
            )
            cache_dir = args.index_cache / name
        hnsw, hnsw_build = build(vectors, base_texts, True, settings, cache_dir)
        configure_faiss_threads(settings.search_threads)
        measured = sorted({*ef_values, hnsw.ef_search()})
        for line in await measure(encoder, queries, flat, hnsw, measured):
            print(line, flush=True)
        print(
            f"{'':>9}  build: flat {flat_build:.1f} s, HNSW (M={settings.hnsw_m}, "
            f"efConstruction={settings.hnsw_ef_construction}) {hnsw_build:.1f} s",
            flush=True,
        )
        del flat, hnsw, vectors
        gc.collect()
    print(f"(load average {os.getloadavg()[0]:.1f} at the end)")
    await encoder.aclose()


if __name__ == "__main__":
    asyncio.run(main())
